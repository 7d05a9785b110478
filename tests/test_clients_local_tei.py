"""The clients against a real local_tei with TEI's small limits and injected faults:
batch 4, max_input_length 32, max_concurrent_requests 4, fault rate 0.3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quarry._http import RetryPolicy
from quarry.chunking import Chunker
from quarry.config import Settings
from quarry.embeddings import EmbeddingClient, EmbedFailure
from quarry.errors import DialectMismatch
from quarry.ingest import IndexSync, run_sync
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from quarry.rerank import RerankClient
from quarry.sources import open_source
from quarry.store import VectorStore, open_client
from tests.conftest import write_corpus

FAST_RETRY = RetryPolicy(budget=20.0, initial=0.0, maximum=0.0, jitter=0.0)
LIMITS: dict[str, Any] = {
    "backend": "hash",
    "dims": 16,
    "max_client_batch_size": 4,
    "max_input_length": 32,
    "max_batch_tokens": 64,
    "max_concurrent_requests": 4,
}
CORPUS = {
    f"doc{i}.md": f"# Heading {i}\n\n"
    + " ".join(f"Word{j} of paragraph {i}." for j in range(8 + 3 * i))
    + "\n\nA second, short paragraph."
    for i in range(10)
}


@pytest.fixture(scope="module")
def clean() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(**LIMITS)) as server:
        yield server


@pytest.fixture(scope="module")
def faulty() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(**LIMITS, fault_rate=0.3)) as server:
        yield server


def ingest(tmp_path: Path, url: str, corpus: Path, chunk_tokens: int = 64) -> dict[str, Any]:
    settings = Settings(data_dir=tmp_path, collection="limits")
    store = VectorStore(open_client(settings), "limits")
    embedder = EmbeddingClient(url, retry=FAST_RETRY, concurrency=4)
    try:
        report = run_sync(
            IndexSync(store, embedder, Chunker(chunk_tokens, 8)), [open_source(corpus)]
        )
        assert report.documents_failed == 0, report.failures
        return {
            str(p.id): (
                {
                    k: v
                    for k, v in (p.payload or {}).items()
                    if k not in ("ingested_at", "metadata")
                },
                [round(x, 6) for x in p.vector],  # type: ignore[union-attr]
            )
            for p in store.scroll(with_vectors=True)
        }
    finally:
        store.close()
        embedder.close()


def test_faults_change_nothing_in_the_index(
    tmp_path: Path, clean: LocalTEIServer, faulty: LocalTEIServer
) -> None:
    corpus = write_corpus(tmp_path / "corpus", CORPUS)
    expected = ingest(tmp_path / "clean", clean.url, corpus)
    faulty.stats.reset()
    got = ingest(tmp_path / "faulty", faulty.url, corpus)
    assert got == expected
    statuses = faulty.stats.responses
    assert statuses.get(429, 0) + statuses.get(503, 0) > 0  # faults really happened


def test_over_long_chunk_becomes_points_that_hold_all_of_it(
    tmp_path: Path, clean: LocalTEIServer
) -> None:
    text = " ".join(f"token{i}" for i in range(40))  # one chunk for tiktoken, 40+ for the model
    corpus = write_corpus(tmp_path / "corpus", {"long.txt": text})
    points = sorted(
        ingest(tmp_path / "data", clean.url, corpus, chunk_tokens=128).values(),
        key=lambda p: p[0]["chunk_index"],
    )
    assert len(points) > 1
    assert "".join(p[0]["text"] for p in points) == text
    assert [p[0]["chunk_index"] for p in points] == list(range(len(points)))
    assert {p[0]["chunk_count"] for p in points} == {len(points)}


def test_one_over_long_input_does_not_fail_the_others(clean: LocalTEIServer) -> None:
    long_text = " ".join(f"w{i}" for i in range(80))
    with EmbeddingClient(clean.url, retry=FAST_RETRY) as client:
        results = client.embed_passages(["short one", long_text, "short two", "short three"])
    assert all(isinstance(result, list) for result in results)
    assert isinstance(results[0], list) and len(results[0]) == 1
    long_parts = results[1]
    assert isinstance(long_parts, list) and len(long_parts) > 1
    assert "".join(part.text for part in long_parts) == long_text


def test_a_rejected_input_is_sent_once(clean: LocalTEIServer) -> None:
    with EmbeddingClient(clean.url, retry=FAST_RETRY) as client:
        _ = client.info
        clean.stats.reset()
        results = client.embed_passages([""])
    assert isinstance(results[0], EmbedFailure)
    assert clean.stats.requests.get(("POST", "/v1/embeddings")) == 1


@pytest.mark.parametrize(
    ("server_dialect", "client_dialect"), [("cohere", "tei"), ("tei", "cohere")]
)
def test_rerank_dialect_mismatch_names_the_fix(server_dialect: str, client_dialect: str) -> None:
    config = LocalTEIConfig(backend="hash", dims=16, rerank_dialect=server_dialect)  # type: ignore[arg-type]
    with (
        LocalTEIServer(config) as server,
        RerankClient(
            server.url,
            retry=FAST_RETRY,
            dialect=client_dialect,  # type: ignore[arg-type]
        ) as reranker,
    ):
        with pytest.raises(DialectMismatch, match=f"QUARRY_RERANK_DIALECT={server_dialect}"):
            reranker.score("query", ["a passage"])


def _tokenize_calls(server: LocalTEIServer) -> int:
    return server.stats.requests.get(("POST", "/tokenize"), 0)


def test_inputs_that_fit_by_their_bytes_are_not_counted(clean: LocalTEIServer) -> None:
    with EmbeddingClient(clean.url, retry=FAST_RETRY) as client:
        _ = client.info
        clean.stats.reset()
        results = client.embed_passages(["short", "tiny one", "a few words"] * 3)
    assert all(isinstance(r, list) and len(r) == 1 for r in results)
    assert _tokenize_calls(clean) == 0


def test_a_long_input_is_split_where_the_count_says_not_by_bisection(
    clean: LocalTEIServer,
) -> None:
    long_text = " ".join(f"w{i}" for i in range(80))  # about 82 tokens, limit 32
    with EmbeddingClient(clean.url, retry=FAST_RETRY) as client:
        _ = client.info
        clean.stats.reset()
        results = client.embed_passages(["short", long_text, "also short"])
    parts = results[1]
    assert isinstance(parts, list) and len(parts) > 1
    assert "".join(part.text for part in parts) == long_text
    assert all(isinstance(r, list) and len(r) == 1 for r in (results[0], results[2]))
    # One refused batch, one count, then the parts: no halving round after round.
    assert clean.stats.responses.get(422, 0) == 1
    assert _tokenize_calls(clean) == 1
    assert clean.stats.requests.get(("POST", "/v1/embeddings"), 0) <= 1 + len(parts)


def test_batches_that_fit_are_sent_without_counting(clean: LocalTEIServer) -> None:
    # ~15 tokens in ~70 bytes: over the 32-token limit by bytes, under it by count.
    medium = [" ".join(f"w{i}x{j}" for j in range(13)) for i in range(40)]
    assert all(len(text) + 8 > LIMITS["max_input_length"] for text in medium)
    with EmbeddingClient(clean.url, retry=FAST_RETRY) as client:
        _ = client.info
        clean.stats.reset()
        results = client.embed_passages(medium)
    assert all(isinstance(r, list) and len(r) == 1 for r in results)
    assert _tokenize_calls(clean) == 0
    assert clean.stats.responses.get(422, 0) == 0


def test_a_corpus_of_long_inputs_is_counted_before_sending(clean: LocalTEIServer) -> None:
    longs = [" ".join(f"d{k}w{i}" for i in range(50)) for k in range(24)]  # each over 32
    with EmbeddingClient(clean.url, retry=FAST_RETRY, concurrency=1) as client:
        _ = client.info
        clean.stats.reset()
        results = client.embed_passages(longs)
        refused_while_learning = clean.stats.responses.get(422, 0)
        clean.stats.reset()
        again = client.embed_passages(longs)
    for text, result in zip(longs, [*results, *again][:24], strict=True):
        assert isinstance(result, list) and "".join(p.text for p in result) == text
    # Two refused batches in a row, then the client counts first (one batch at a time here).
    assert refused_while_learning == 2
    assert clean.stats.responses.get(422, 0) == 0  # counted first now: nothing refused
    assert _tokenize_calls(clean) > 0


def test_batches_fit_a_service_with_fewer_permits_than_its_batch_size() -> None:
    # TEI takes a permit per input: a batch of 32 against 4 permits is refused forever.
    config = LocalTEIConfig(backend="hash", dims=8, max_concurrent_requests=4)
    with LocalTEIServer(config) as tei:
        embedder = EmbeddingClient(tei.url, retry=FAST_RETRY)
        reranker = RerankClient(tei.url, retry=FAST_RETRY)
        try:
            vectors = embedder.embed_passages([f"passage {i}" for i in range(20)])
            scores = reranker.score("query", [f"passage {i}" for i in range(10)])
        finally:
            embedder.close()
            reranker.close()
        assert len(vectors) == 20 and len(scores) == 10
        assert tei.stats.responses.get(429, 0) == 0


@pytest.fixture(scope="module")
def truncating() -> Iterator[LocalTEIServer]:
    """TEI's default since 1.9 (``--auto-truncate``): /v1/embeddings cuts, never refuses."""
    with LocalTEIServer(LocalTEIConfig(**LIMITS, auto_truncate=True)) as server:
        yield server


def _model_tokens(client: EmbeddingClient, texts: list[str]) -> list[int]:
    """The service's own count of each text (one request each: its batch limit is 4)."""
    counts = []
    for text in texts:
        counted = client._http.post(
            f"{client.base_url}/tokenize", json={"inputs": [text], "add_special_tokens": True}
        )
        assert counted.status_code == 200, counted.text
        counts.append(len(counted.json()[0]))
    return counts


@pytest.mark.parametrize("dialect", ["auto", "openai"])
def test_a_service_that_would_truncate_gets_over_long_inputs_split_first(
    truncating: LocalTEIServer, dialect: str
) -> None:
    # Review trial: against a stock TEI an ingest stored vectors of the first 32 tokens
    # of a 94-token chunk, with no failure and no split. ``auto`` now asks /embed
    # (``truncate: false``: refused, then split); ``openai``, set by hand, counts first.
    # Words of ten letters (a token each), then dots (a token each): parts cut by
    # their share of the characters are over the limit on the dotted side.
    long_text = " ".join(f"word{i:06d}" for i in range(24)) + " " + "." * 60
    with EmbeddingClient(
        truncating.url,
        retry=FAST_RETRY,
        dialect=dialect,  # type: ignore[arg-type]
    ) as client:
        results = client.embed_passages(["short", long_text])
        parts = results[1]
        assert isinstance(parts, list) and len(parts) > 1
        assert "".join(part.text for part in parts) == long_text
        assert max(_model_tokens(client, [part.text for part in parts])) <= 32
        assert client.dialect == ("tei" if dialect == "auto" else "openai")
    embed_route = "/embed" if dialect == "auto" else "/v1/embeddings"
    assert truncating.stats.requests.get(("POST", embed_route), 0) > 0


def test_a_full_batch_split_for_a_truncating_service_keeps_counting() -> None:
    # Review trial: the parts of a full batch, counted again in one /tokenize request,
    # were over the service's batch limit; the 422 turned counting off for good, and
    # every later over-long input was cut.
    longs = [" ".join(f"w{k}x{i}" for i in range(40)) for k in range(4)]
    later = " ".join(f"later{i}" for i in range(80))
    config = LocalTEIConfig(**{**LIMITS, "max_batch_tokens": 1024}, auto_truncate=True)
    with (
        LocalTEIServer(config) as truncating,
        EmbeddingClient(truncating.url, retry=FAST_RETRY, dialect="openai") as client,
    ):
        first = client.embed_passages(longs)
        then = client.embed_passages([later])[0]
        assert isinstance(then, list) and len(then) > 1
        for text, result in zip([*longs, later], [*first, then], strict=True):
            assert isinstance(result, list) and "".join(p.text for p in result) == text
            assert max(_model_tokens(client, [p.text for p in result])) <= 32
        assert truncating.stats.responses.get(422, 0) == 0


def test_a_query_over_the_limit_of_a_truncating_service_is_refused_not_cut(
    truncating: LocalTEIServer,
) -> None:
    import asyncio

    from quarry._async_clients import AsyncEmbeddingClient
    from quarry.errors import InputTooLong

    async def embed() -> None:
        client = AsyncEmbeddingClient(truncating.url, retry=FAST_RETRY)
        try:
            assert len(await client.embed_query("a short question")) == 16
            with pytest.raises(InputTooLong, match="must have less than"):
                await client.embed_query(" ".join(f"word{i}" for i in range(60)))
        finally:
            await client.aclose()

    asyncio.run(embed())
