"""The query API against a real local_tei (hash backend) and local-mode Qdrant.

One collection is built per module with the real ingest; each app gets its own
copy of it (local-mode Qdrant admits one client per folder), so every test can
configure the app its own way. Dead dependencies are loopback ports nobody
listens on, and the retry budget is zero, so nothing here waits.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from starlette.testclient import TestClient

from quarry._http import NO_WAIT
from quarry.api import check_bind_address, create_app, serve
from quarry.chunking import Chunker, count_tokens
from quarry.config import Settings
from quarry.embeddings import EmbeddingClient
from quarry.errors import ConfigError, FingerprintMismatch, StoreLocked
from quarry.fingerprint import cosine
from quarry.ingest import IndexSync, run_sync
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from quarry.rerank import RerankClient
from quarry.search import Searcher, SearchFilter
from quarry.sources import open_source
from quarry.store import VectorStore, open_client
from tests.conftest import write_corpus

KEY = "test-key-9f8e7d6c5b4a"
AUTH = {"Authorization": f"Bearer {KEY}"}
CORPUS = {
    "alpha.md": "# Alpha\n\nAlpha is the first letter of the Greek alphabet. " * 12,
    "beta.md": "# Beta\n\nBeta comes second, after alpha.\n\n## More\n\nBeta rays are electrons. "
    * 8,
    "notes/gamma.txt": "Gamma rays are energetic photons from radioactive decay. " * 20,
    "notes/delta.md": "# Delta\n\nA river delta is shaped like a triangle, the letter delta.",
}
RESULT_FIELDS = {
    "text",
    "score",
    "vector_score",
    "rerank_score",
    "doc_id",
    "uri",
    "chunk_index",
    "headings",
    "title",
    "metadata",
}


def _build_collection(
    data_dir: Path, corpus: Path, url: str, collection: str = "test", **embedder: Any
) -> str:
    """Ingest ``corpus`` into ``collection`` (an alias) and return its physical collection."""
    settings = Settings(data_dir=data_dir, collection=collection)
    store = VectorStore(open_client(settings), collection)
    client = EmbeddingClient(url, retry=NO_WAIT, **embedder)
    try:
        report = run_sync(IndexSync(store, client, Chunker(48, 8)), [open_source(corpus)])
        assert report.documents_failed == 0
        physical = store.resolve()
        assert physical is not None
        return physical
    finally:
        store.close()
        client.close()


@pytest.fixture(scope="module")
def tei() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32)) as server:
        yield server


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, tei: LocalTEIServer) -> Path:
    """A data dir holding the collection ``test`` of CORPUS, built by the real ingest."""
    base = tmp_path_factory.mktemp("api")
    corpus = write_corpus(base / "corpus", CORPUS)
    _build_collection(base / "data", corpus, tei.url)
    return base / "data"


# qdrant-client checks a server's version from a thread of its own; against a Qdrant
# that is down it warns whenever that thread gets there, which may be a later test.
pytestmark = pytest.mark.filterwarnings("ignore:Failed to obtain server version:UserWarning")


def _dead_url() -> str:
    """A loopback URL where nothing listens: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextmanager
def _silent_url() -> Iterator[str]:
    """A loopback URL that takes connections and never answers: a hung service."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


AppFactory = Callable[..., TestClient]


def _start_app(
    stack: ExitStack, data_dir: Path, source: Path, url: str, root_path: str = "", **overrides: Any
) -> TestClient:
    shutil.copytree(source, data_dir, ignore=shutil.ignore_patterns(".lock"))
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "collection": "test",
        "embed_url": url,
        "api_key": SecretStr(KEY),
        "retry_budget": 0.0,
    }
    values.update(overrides)
    client = TestClient(
        create_app(Settings(**values)), raise_server_exceptions=False, root_path=root_path
    )
    return stack.enter_context(client)


@pytest.fixture
def make_app(tmp_path: Path, template: Path, tei: LocalTEIServer) -> Iterator[AppFactory]:
    """Start an app on a fresh copy of the collection; keyword arguments override Settings."""
    with ExitStack() as stack:
        copies = 0

        def factory(*, data: Path | None = None, **overrides: Any) -> TestClient:
            nonlocal copies
            copies += 1
            return _start_app(
                stack, tmp_path / f"data{copies}", data or template, tei.url, **overrides
            )

        yield factory


@pytest.fixture(scope="module")
def app(
    tmp_path_factory: pytest.TempPathFactory, template: Path, tei: LocalTEIServer
) -> Iterator[TestClient]:
    """One app with the default settings for the tests that only read."""
    with ExitStack() as stack:
        yield _start_app(stack, tmp_path_factory.mktemp("shared") / "data", template, tei.url)


def query(client: TestClient, body: dict[str, Any], **kwargs: Any) -> Any:
    return client.post("/v1/query", json=body, headers={**AUTH, **kwargs.pop("headers", {})})


def assert_error(response: Any, status: int, kind: str) -> dict[str, Any]:
    """The one error shape, with the request id of the response header."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error"}
    error = body["error"]
    assert error["type"] == kind, error
    assert error["message"]
    assert error["request_id"] == response.headers["x-request-id"]
    assert "Traceback" not in response.text
    return dict(error)


# -- the query path ---------------------------------------------------------------------------


def test_query_returns_reranked_passages_best_first(app: TestClient) -> None:
    response = query(app, {"query": "gamma rays photons", "top_k": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) >= {"results", "model", "reranked", "timings_ms", "truncated"}
    assert body["reranked"] is True
    assert body["truncated"] is False
    results = body["results"]
    assert 0 < len(results) <= 5
    assert all(set(result) == RESULT_FIELDS for result in results)
    scores = [result["score"] for result in results]
    assert scores == sorted(scores, reverse=True)
    assert all(result["rerank_score"] == result["score"] for result in results)
    assert results[0]["uri"] == "corpus/notes/gamma.txt"
    assert set(body["timings_ms"]) == {"embed", "search", "rerank", "total"}
    # The server's whole time on the request covers the query path inside it.
    name, _, duration = response.headers["server-timing"].partition(";dur=")
    assert name == "app"
    assert float(duration) >= body["timings_ms"]["total"]
    assert "warning" not in response.headers
    collections = app.get("/v1/collections", headers=AUTH).json()["collections"]
    assert body["model"] == collections[0]["model"]


def test_top_k_and_threshold_cut_the_answer(app: TestClient) -> None:
    everything = query(app, {"query": "alpha letter", "top_k": 100, "threshold": -1.0}).json()
    assert len(everything["results"]) > 3
    assert len(query(app, {"query": "alpha letter", "top_k": 2}).json()["results"]) == 2
    cut = sorted(r["score"] for r in everything["results"])[len(everything["results"]) // 2]
    kept = query(app, {"query": "alpha letter", "top_k": 100, "threshold": cut}).json()
    assert kept["results"]
    assert all(result["score"] >= cut for result in kept["results"])
    assert len(kept["results"]) < len(everything["results"])


def test_default_threshold_comes_from_settings(make_app: AppFactory) -> None:
    strict = make_app(rerank_threshold=0.99)
    loose = make_app(rerank_threshold=-1.0)
    body = {"query": "delta triangle", "top_k": 100}
    strict_results = query(strict, body).json()["results"]
    loose_results = query(loose, body).json()["results"]
    assert all(result["score"] >= 0.99 for result in strict_results)
    assert len(loose_results) > len(strict_results)


def test_rerank_off_answers_from_vector_scores(app: TestClient) -> None:
    response = query(app, {"query": "beta electrons", "rerank": False})
    body = response.json()
    assert body["reranked"] is False
    assert body["results"]
    for result in body["results"]:
        assert result["rerank_score"] is None
        assert result["score"] == result["vector_score"]
    assert "rerank" not in body["timings_ms"]
    assert "warning" not in response.headers


def test_filters_restrict_the_candidates(app: TestClient) -> None:
    base = {"query": "letter rays", "top_k": 100, "threshold": -1.0}
    notes = query(app, {**base, "filter": {"uri_prefix": "corpus/notes"}}).json()["results"]
    assert notes
    assert {result["uri"] for result in notes} == {
        "corpus/notes/gamma.txt",
        "corpus/notes/delta.md",
    }

    beta_id = next(
        r["doc_id"] for r in query(app, base).json()["results"] if r["uri"] == "corpus/beta.md"
    )
    only_beta = query(app, {**base, "filter": {"doc_ids": [beta_id]}}).json()["results"]
    assert only_beta
    assert {result["doc_id"] for result in only_beta} == {beta_id}

    plain = query(app, {**base, "filter": {"metadata": {"content_type": "text/plain"}}}).json()
    assert {result["uri"] for result in plain["results"]} == {"corpus/notes/gamma.txt"}


def test_collapse_doc_keeps_one_passage_per_document(app: TestClient) -> None:
    body = {"query": "gamma rays alpha beta", "top_k": 100, "threshold": -1.0}
    everything = [r["doc_id"] for r in query(app, body).json()["results"]]
    assert len(everything) > len(set(everything))  # several chunks of some document
    collapsed = [r["doc_id"] for r in query(app, {**body, "collapse": "doc"}).json()["results"]]
    assert len(collapsed) == len(set(collapsed)) == len(set(everything))


def test_api_answers_as_the_cli_searcher_does(
    app: TestClient, template: Path, tmp_path: Path, tei: LocalTEIServer
) -> None:
    """`quarry query` (the sync Searcher) and the API share search.py: same answer."""
    copy = tmp_path / "cli-copy"
    shutil.copytree(template, copy, ignore=shutil.ignore_patterns(".lock"))
    settings = Settings(data_dir=copy, collection="test")
    store = VectorStore(open_client(settings), "test")
    embedder = EmbeddingClient(tei.url, retry=NO_WAIT)
    reranker = RerankClient(tei.url, retry=NO_WAIT)
    try:
        searcher = Searcher(store, embedder, reranker, threshold=settings.rerank_threshold)
        for request, kwargs in [
            ({"query": "alpha beta letters", "top_k": 7}, {"top_k": 7}),
            (
                {"query": "rays", "rerank": False, "collapse": "doc"},
                {"rerank": False, "collapse": "doc"},
            ),
            (
                {"query": "triangle", "filter": {"uri_prefix": "corpus/notes"}, "threshold": 0.1},
                {"search_filter": SearchFilter(uri_prefix="corpus/notes"), "threshold": 0.1},
            ),
        ]:
            expected = searcher.search(str(request["query"]), **kwargs).to_dict()
            got = query(app, request).json()
            assert got["reranked"] == expected["reranked"]
            assert got["model"] == expected["model"]
            assert [(r["doc_id"], r["chunk_index"]) for r in got["results"]] == [
                (r["doc_id"], r["chunk_index"]) for r in expected["results"]
            ]
            assert [r["score"] for r in got["results"]] == pytest.approx(
                [r["score"] for r in expected["results"]]
            )
    finally:
        store.close()
        embedder.close()
        reranker.close()


def test_query_is_formatted_with_the_recorded_profile_and_task(
    make_app: AppFactory, tmp_path: Path, tei: LocalTEIServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The index's task wins over a QUARRY_QUERY_TASK changed since it was built, and
    the log says so once (operator trial: it did so without a word)."""
    caplog.set_level(logging.INFO, logger="quarry.api")
    corpus = write_corpus(tmp_path / "corpus", {"one.md": "Quarry water is forty metres deep."})
    recorded = {"prompt_profile": "e5-instruct", "query_task": "Find the depth"}
    _build_collection(tmp_path / "instr", corpus, tei.url, **recorded)
    app = make_app(data=tmp_path / "instr", prompt_profile="e5-instruct", query_task="Other")
    answer = query(app, {"query": "how deep", "rerank": False}).json()
    hit = answer["results"][0]
    assert query(app, {"query": "how deep", "rerank": False}).status_code == 200
    assert app.get("/readyz").status_code == 200  # judges the fingerprints again
    said = [r.getMessage() for r in caplog.records if "QUARRY_QUERY_TASK" in r.getMessage()]
    warning = (
        "queries of 'test' use the task its index records ('Find the depth'), "
        "not QUARRY_QUERY_TASK ('Other'); `quarry reindex` records the new one"
    )
    assert said == [f"quarry api: {warning}"]
    # Each answer says so too, as `quarry query` does (review: only the log did).
    assert answer["warnings"] == [warning]

    store = VectorStore(open_client(Settings(data_dir=tmp_path / "instr")), "test")
    try:
        (point,) = list(store.scroll(with_vectors=True))
    finally:
        store.close()
    with EmbeddingClient(tei.url, retry=NO_WAIT) as client:
        right, wrong = client.embed_raw(
            ["Instruct: Find the depth\nQuery: how deep", "Instruct: Other\nQuery: how deep"]
        )
    vector = point.vector
    assert isinstance(vector, list)
    assert hit["vector_score"] == pytest.approx(cosine(right, vector), abs=1e-5)
    assert hit["vector_score"] != pytest.approx(cosine(wrong, vector), abs=1e-5)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"query": ""},
        {"query": "   \n\t"},
        {"query": "\u0000"},  # API trial: a NUL or a zero-width space was embedded, 200
        {"query": " \u200b\u200d "},
        {"top_k": 3},
        {"query": "x", "top_k": 0},
        {"query": "x", "top_k": 101},
        {"query": "x", "candidates": 0},
        {"query": "x", "top_k": 2.5},
        {"query": "x", "top_k": "2"},
        {"query": "x", "colour": "blue"},
        {"query": "x", "filter": {"uri_prefix": "a", "path": "b"}},
        {"query": "x", "filter": {"doc_ids": []}},
        {"query": "x", "filter": {"metadata": {"size": 1.5}}},
        {"query": "x", "filter": {"metadata": {"a.b": "c"}}},
        {"query": "x", "collapse": "page"},
        {"query": "x", "rerank": "yes"},
        {"query": 42},
    ],
    ids=lambda body: json.dumps(body),
)
def test_bad_input_is_a_422_in_the_error_shape(app: TestClient, body: dict[str, Any]) -> None:
    error = assert_error(query(app, body), 422, "invalid_request")
    assert error["details"]


def test_integral_numbers_are_integers_as_json_schema_says(app: TestClient) -> None:
    answered = query(app, {"query": "gamma rays", "top_k": 2.0, "candidates": 4.0})
    assert answered.status_code == 200, answered.text
    assert len(answered.json()["results"]) == 2


def test_malformed_json_is_a_422_saying_where_and_why(app: TestClient) -> None:
    response = app.post(
        "/v1/query",
        content=b'{"query": "x",}',
        headers={**AUTH, "content-type": "application/json"},
    )
    error = assert_error(response, 422, "invalid_request")
    # Not "14: JSON decode error", as if character 14 were a field.
    assert error["message"] == (
        "body: not valid JSON at character 14: Expecting property name enclosed in double quotes"
    )


@pytest.mark.parametrize(
    ("content", "message", "kind"),
    [
        (b'{"query": "caf\xe9"}', "body: not UTF-8 (byte 0xe9 at position 14)", "utf8"),
        (
            b'{"query": "x", "filter": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "body: JSON nested too deeply to read",
            "json_too_deep",
        ),
    ],
)
def test_a_body_that_cannot_be_read_as_json_is_a_422_saying_why(
    app: TestClient, content: bytes, message: str, kind: str
) -> None:
    response = app.post(
        "/v1/query", content=content, headers={**AUTH, "content-type": "application/json"}
    )
    error = assert_error(response, 422, "invalid_request")
    assert error["message"].startswith(message), error
    assert error["details"] == [{"loc": ["body"], "msg": error["message"][6:], "type": kind}]


def test_a_metadata_value_of_no_allowed_kind_is_one_error_naming_the_kinds(
    app: TestClient,
) -> None:
    for value in (1.5, None, [1], "x" * 1025, 2**63):
        response = query(app, {"query": "x", "filter": {"metadata": {"size": value}}})
        error = assert_error(response, 422, "invalid_request")
        assert error["message"] == (
            "filter.metadata.size: must be a string of up to 1,024 characters, "
            "a 64-bit integer or a boolean"
        ), value
        assert len(error["details"]) == 1
    for value in ("text/markdown", 3, 3.0, True):
        answered = query(app, {"query": "gamma", "filter": {"metadata": {"size": value}}})
        assert answered.status_code == 200, (value, answered.text)


def test_a_body_of_thousands_of_bad_keys_gets_one_short_answer(app: TestClient) -> None:
    # Each bad key was one error in the answer: 60,000 made 5-9 MB of JSON.
    unknown = {f"field{i}": 1 for i in range(5000)}
    error = assert_error(query(app, {"query": "x", **unknown}), 422, "invalid_request")
    assert error["message"].startswith("body: 5000 unknown fields, such as 'field0'")
    assert len(error["details"]) == 1
    many = {f"key{i}": "x" for i in range(5000)}
    response = query(app, {"query": "x", "filter": {"metadata": many}})
    error = assert_error(response, 422, "invalid_request")
    assert error["message"] == "filter.metadata: at most 32 metadata conditions, not 5000"
    bad_values = {f"key{i}": None for i in range(30)}
    response = query(app, {"query": "x", "top_k": 0, "filter": {"metadata": bad_values}})
    details = assert_error(response, 422, "invalid_request")["details"]
    assert len(details) == 21
    assert details[-1] == {"loc": [], "msg": "11 more errors not listed", "type": "too_many_errors"}
    # A few unknown fields are still named one by one.
    error = assert_error(query(app, {"query": "x", "colour": 1, "size": 2}), 422, "invalid_request")
    assert [d["loc"] for d in error["details"]] == [["body", "colour"], ["body", "size"]]


def test_local_mode_takes_at_most_a_hundred_doc_ids(app: TestClient) -> None:
    # Local-mode Qdrant tests every point against every id, on the thread all queries share.
    ids = [f"doc-{i}" for i in range(101)]
    response = query(app, {"query": "gamma", "filter": {"doc_ids": ids}})
    error = assert_error(response, 422, "invalid_request")
    assert "at most 100 ids with local-mode Qdrant, not 101" in error["message"]
    assert "QUARRY_QDRANT_URL" in error["message"]
    # With details, as every other invalid_request 422 (review trial: it had none).
    assert error["details"] == [
        {
            "loc": ["body", "filter", "doc_ids"],
            "msg": "at most 100 ids with local-mode Qdrant",
            "type": "too_long",
        }
    ]
    answered = query(app, {"query": "gamma", "filter": {"doc_ids": ids[:100]}})
    assert answered.status_code == 200, answered.text


def test_a_json_body_sent_as_a_form_is_told_to_say_json(app: TestClient) -> None:
    # curl -d '{"query": "x"}' sends application/x-www-form-urlencoded.
    form = {**AUTH, "content-type": "application/x-www-form-urlencoded"}
    response = app.post("/v1/query", content=b'{"query": "gamma"}', headers=form)
    error = assert_error(response, 422, "invalid_request")
    assert (
        "Content-Type: application/json (not application/x-www-form-urlencoded)"
        in (error["message"])
    )


def test_query_over_max_query_tokens_is_refused_unless_truncated(make_app: AppFactory) -> None:
    app = make_app(max_query_tokens=8)
    long_query = "gamma rays are energetic photons from radioactive decay of nuclei in stars"
    assert count_tokens(long_query) > 8
    error = assert_error(query(app, {"query": long_query}), 422, "query_too_long")
    assert "QUARRY_MAX_QUERY_TOKENS" in error["message"]
    assert "truncate" in error["message"]

    cut = query(app, {"query": long_query, "truncate": True})
    assert cut.status_code == 200, cut.text
    assert cut.json()["truncated"] is True
    assert cut.json()["results"]
    fits = query(app, {"query": "gamma rays", "truncate": True})
    assert fits.json()["truncated"] is False
    short = query(app, {"query": "hi"})  # 2 characters: at most 8 bytes, so not counted
    assert short.status_code == 200 and short.json()["truncated"] is False


@pytest.fixture
def short_tei() -> Iterator[LocalTEIServer]:
    """The same model with a smaller max_input_length (the canary still fits)."""
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32, max_input_length=32)) as server:
        yield server


@pytest.fixture
def other_tei() -> Iterator[LocalTEIServer]:
    """Another model: the hash backend with another seed."""
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32, seed=7)) as server:
        yield server


# The servers come before make_app: its apps are closed first, with no connection left open.


def test_query_over_the_models_input_limit_is_refused_unless_truncated(
    short_tei: LocalTEIServer, make_app: AppFactory
) -> None:
    # Another max_input_length is a serving change, allowed here.
    app = make_app(embed_url=short_tei.url, allow_serving_change=True)
    long_query = " ".join(["gamma", "rays", "photons", "decay"] * 10)
    assert count_tokens(long_query) < 512  # under QUARRY_MAX_QUERY_TOKENS
    error = assert_error(query(app, {"query": long_query}), 422, "query_too_long")
    assert "32 tokens" in error["message"]
    assert short_tei.url not in error["message"]

    # (No rerank: passages split to fit a 32-token reranker make a slow test.)
    cut = query(app, {"query": long_query, "truncate": True, "rerank": False})
    assert cut.status_code == 200, cut.text
    assert cut.json()["truncated"] is True
    assert cut.json()["results"][0]["uri"] == "corpus/notes/gamma.txt"


# -- auth -------------------------------------------------------------------------------------


def test_queries_need_the_api_key(app: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    body = {"query": "alpha"}
    missing = app.post("/v1/query", json=body)
    assert_error(missing, 401, "unauthorized")
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = app.post("/v1/query", json=body, headers={"Authorization": f"Bearer {KEY[:-1]}x"})
    assert_error(wrong, 401, "unauthorized")
    basic = app.post("/v1/query", json=body, headers={"Authorization": f"Basic {KEY}"})
    assert_error(basic, 401, "unauthorized")
    assert_error(app.get("/v1/collections"), 401, "unauthorized")
    assert query(app, body).status_code == 200
    assert app.get("/v1/collections", headers=AUTH).status_code == 200
    # Probes need no key.
    assert app.get("/healthz").status_code == 200
    assert app.get("/readyz").status_code == 200
    assert caplog.records
    for record in caplog.records:
        assert KEY[:-1] not in record.getMessage()


def test_a_request_without_the_key_is_refused_before_its_body_is_read(
    app: TestClient,
) -> None:
    json_type = {"Content-Type": "application/json"}
    # Malformed JSON without a key: 401, so the body was not parsed (it would be a 422).
    assert_error(
        app.post("/v1/query", content=b"{not json", headers=json_type), 401, "unauthorized"
    )
    huge = b'{"query": "' + b"a" * (2 * 1024 * 1024) + b'"}'
    assert_error(app.post("/v1/query", content=huge, headers=json_type), 401, "unauthorized")
    # With the key, a body over QUARRY_API_MAX_BODY_BYTES is a 413, declared or streamed.
    declared = app.post("/v1/query", content=huge, headers={**AUTH, **json_type})
    assert_error(declared, 413, "body_too_large")

    def chunked() -> Iterator[bytes]:
        yield huge[: 512 * 1024]
        yield huge[512 * 1024 :]

    streamed = app.post("/v1/query", content=chunked(), headers={**AUTH, **json_type})
    assert "content-length" not in streamed.request.headers
    assert_error(streamed, 413, "body_too_large")
    assert query(app, {"query": "alpha"}).status_code == 200


def test_the_key_is_checked_before_the_body_under_a_root_path(make_app: AppFactory) -> None:
    # Mounted under a prefix (a proxy, `uvicorn --root-path`), the path the server sees
    # starts with it: the early check must still know a protected route.
    app = make_app(root_path="/search")
    json_type = {"Content-Type": "application/json"}
    refused = app.post("/search/v1/query", content=b"{not json", headers=json_type)
    assert_error(refused, 401, "unauthorized")  # a 422 would mean the body was parsed
    assert_error(app.get("/search/v1/collections"), 401, "unauthorized")
    answered = app.post("/search/v1/query", json={"query": "alpha"}, headers=AUTH)
    assert answered.status_code == 200, answered.text


def test_the_query_route_checks_the_key_itself(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Defence in depth: with the middleware's early check out of the way, the route
    # (which skips FastAPI's dependency for speed) still refuses.
    import quarry.api as api

    monkeypatch.setattr(api, "_refuse_early", lambda scope, settings, request_id: None)
    app = make_app()
    body = {"query": "alpha"}
    assert_error(app.post("/v1/query", json=body), 401, "unauthorized")
    wrong = app.post("/v1/query", json=body, headers={"Authorization": f"Bearer {KEY}x"})
    assert_error(wrong, 401, "unauthorized")
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert_error(app.get("/v1/collections"), 401, "unauthorized")
    assert query(app, body).status_code == 200


@pytest.mark.parametrize("key", ["clé-secrète", "two words", "tab\there"])
def test_a_key_no_header_can_carry_stops_startup(tmp_path: Path, key: str) -> None:
    settings = Settings(data_dir=tmp_path, api_key=SecretStr(key))
    with pytest.raises(ConfigError, match="QUARRY_API_KEY") as refused:
        create_app(settings)
    assert key not in str(refused.value)  # the key itself is never printed


def test_a_key_read_with_a_trailing_newline_still_matches(make_app: AppFactory) -> None:
    app = make_app(api_key=SecretStr(KEY + "\n"))
    assert query(app, {"query": "alpha"}).status_code == 200
    assert_error(app.post("/v1/query", json={"query": "alpha"}), 401, "unauthorized")


def test_probes_answer_head_requests(app: TestClient) -> None:
    for path in ("/healthz", "/readyz"):
        response = app.head(path)
        assert response.status_code == 200, path
        assert response.content == b""
        assert response.headers["x-request-id"]


def test_auth_disabled_or_no_key_serves_without_a_header(make_app: AppFactory) -> None:
    for app in (make_app(api_auth="disabled"), make_app(api_key=None)):
        assert app.post("/v1/query", json={"query": "alpha"}).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.org"])
def test_serve_refuses_a_public_host_without_a_key(host: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(ConfigError, match="QUARRY_API_KEY"):
        serve(settings, host, 0)
    with pytest.raises(ConfigError, match="QUARRY_API_AUTH=disabled"):
        check_bind_address(settings, host)
    check_bind_address(Settings(data_dir=tmp_path, api_key=SecretStr(KEY)), host)
    check_bind_address(Settings(data_dir=tmp_path, api_auth="disabled"), host)
    # An empty key is no key.
    with pytest.raises(ConfigError):
        check_bind_address(Settings(data_dir=tmp_path, api_key=SecretStr(" ")), host)


def test_serve_lets_queries_in_flight_at_shutdown_end_within_their_own_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configs: list[Any] = []

    class Server:
        def __init__(self, config: Any) -> None:
            configs.append(config)

        def run(self) -> None:
            pass

    monkeypatch.setattr("quarry.api.uvicorn.Server", Server)
    serve(Settings(data_dir=tmp_path, query_timeout=30.0), host="127.0.0.1", port=_free_port())
    # uvicorn cancels what is still running after its graceful timeout: a plain-text 500.
    assert configs[0].timeout_graceful_shutdown > 30.0


def _blas_threads() -> set[int]:
    from threadpoolctl import threadpool_info

    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_an_embedded_local_tei_leaves_the_hosts_uvicorn_log_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # API trial: on the embedded default, `quarry api` never said where it listened:
    # the local service's uvicorn set the shared "uvicorn.error" logger to WARNING.
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    host = logging.getLogger("uvicorn.error")
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=8)) as embedded:
        host.info("Uvicorn running on http://127.0.0.1:8000")
        assert embedded.url
    assert host.level == logging.INFO
    said = [r.getMessage() for r in caplog.records if r.name == "uvicorn.error"]
    assert said == ["Uvicorn running on http://127.0.0.1:8000"]  # not the embedded one's


@pytest.mark.parametrize(
    ("qdrant_url", "environment", "threads"),
    [
        (None, {}, 1),
        ("http://127.0.0.1:6333", {}, 2),
        (None, {"OPENBLAS_NUM_THREADS": "2"}, 2),
    ],
    ids=["local-mode", "qdrant-server", "set-by-the-user"],
)
def test_serve_searches_local_mode_on_one_blas_thread(
    qdrant_url: str | None,
    environment: dict[str, str],
    threads: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second BLAS thread spins after each of local mode's matrix-vector products; a
    # Qdrant server searches in its own process, and a thread count the environment
    # sets is the user's: BLAS is then left as it was.
    import numpy  # noqa: F401  (loads the BLAS whose threads are counted)
    from threadpoolctl import threadpool_limits

    if not _blas_threads():
        pytest.skip("threadpoolctl sees no BLAS library here (e.g. Apple's Accelerate)")
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    during: list[set[int]] = []

    class Server:
        def __init__(self, config: Any) -> None:
            pass

        def run(self) -> None:
            during.append(_blas_threads())

    monkeypatch.setattr("quarry.api.uvicorn.Server", Server)
    with threadpool_limits(limits=2, user_api="blas"):  # as on any machine with 2+ cores
        settings = Settings(data_dir=tmp_path, qdrant_url=qdrant_url)
        serve(settings, host="127.0.0.1", port=_free_port())
        assert during == [{threads}]
        assert _blas_threads() == {2}  # given back when the server stops


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_serve_allows_loopback_without_a_key(host: str, tmp_path: Path) -> None:
    check_bind_address(Settings(data_dir=tmp_path), host)


# -- request ids and the error shape ----------------------------------------------------------


def test_request_id_is_echoed_in_headers_bodies_and_logs(
    app: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quarry.api")
    given = "client-req-0042"
    ok = query(app, {"query": "alpha"}, headers={"X-Request-ID": given})
    assert ok.headers["x-request-id"] == given
    bad = query(app, {"query": ""}, headers={"X-Request-ID": given})
    assert assert_error(bad, 422, "invalid_request")["request_id"] == given
    assert any(given in record.getMessage() for record in caplog.records)

    made = query(app, {"query": "alpha"})
    assert len(made.headers["x-request-id"]) >= 16
    assert made.headers["x-request-id"] != query(app, {"query": "a"}).headers["x-request-id"]
    # A request id that could corrupt the logs is replaced, not echoed.
    odd = query(app, {"query": "alpha"}, headers={"X-Request-ID": "a b\tc" + "x" * 200})
    assert odd.headers["x-request-id"] != "a b\tc" + "x" * 200


def _asgi_query(app: TestClient, body: bytes, gone: Any) -> list[dict[str, Any]]:
    """POST /v1/query straight to the ASGI app on the client's event loop, as a server
    would; the client goes away when ``gone`` (an asyncio.Event) is set. What was sent."""
    import asyncio

    async def scenario() -> list[dict[str, Any]]:
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                gone.set()  # as a server does once the answer is out

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/query",
            "raw_path": b"/v1/query",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"authorization", f"Bearer {KEY}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8080),
            "state": dict(app.app_state),
        }
        await asyncio.wait_for(app.app(scope, receive, send), 10)
        return sent

    assert app.portal is not None
    return app.portal.call(scenario)


def test_a_query_whose_client_goes_away_is_cancelled_not_finished(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    caplog.set_level(logging.INFO, logger="quarry.api")
    app = make_app()
    embedder = app.app_state["query_service"].embedder
    real = embedder.embed_query
    seen: list[str] = []
    gone: list[Any] = []

    async def slow(*args: Any, **kwargs: Any) -> Any:
        seen.append("embedding")
        if gone:
            asyncio.get_running_loop().call_later(0.05, gone[0].set)  # the client leaves
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return await real(*args, **kwargs)

    embedder.embed_query = slow
    body = json.dumps({"query": "gamma rays"}).encode()

    async def event() -> Any:
        gone.append(asyncio.Event())
        return gone[0]

    sent = _asgi_query(app, body, app.portal.call(event))  # type: ignore[union-attr]
    # The embedding it waited on was cancelled, nothing was sent to nobody, and the log
    # says why the request ended (nginx's 499: the client closed the request).
    assert seen == ["embedding", "cancelled"]
    assert sent == []
    lines = [r.getMessage() for r in caplog.records]
    assert any("client closed the connection" in line for line in lines), lines
    assert any(line.endswith("POST /v1/query 499 " + line.split()[-1]) for line in lines)
    # A client that stays gets its answer, and the disconnect after it cancels nothing.
    embedder.embed_query = real
    gone.clear()
    answered = _asgi_query(app, body, app.portal.call(event))  # type: ignore[union-attr]
    assert answered[0]["status"] == 200


@pytest.mark.parametrize(("cancels", "taken_back"), [(1, True), (2, False)])
def test_a_cancellation_the_server_also_asked_for_is_not_taken_back(
    cancels: int, taken_back: bool
) -> None:
    import asyncio

    from quarry.api import _DisconnectWatch

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def main() -> bool:
        watch = _DisconnectWatch(receive)
        task = asyncio.current_task()
        assert task is not None
        watch._task, watch._cancelled = task, True  # the watch cancelled it...
        for _ in range(cancels):  # ...and, the second time, the server (its shutdown)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(1)
        answer = watch.cancelled_request()
        while task.cancelling():
            task.uncancel()
        return answer

    assert asyncio.run(main()) is taken_back


def test_unknown_routes_and_methods_use_the_error_shape(app: TestClient) -> None:
    assert_error(app.get("/v2/query", headers=AUTH), 404, "not_found")
    assert_error(app.get("/v1/query", headers=AUTH), 405, "method_not_allowed")
    slash = app.post("/v1/query/", json={"query": "q"}, headers=AUTH, follow_redirects=False)
    assert_error(slash, 404, "not_found")


def test_an_unexpected_failure_is_a_500_without_a_stack_trace(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()

    async def broken() -> None:
        raise RuntimeError("secret internals")

    app.app.add_api_route("/boom", broken)  # type: ignore[attr-defined]
    response = app.get("/boom")
    error = assert_error(response, 500, "internal_error")
    assert "secret internals" not in response.text
    assert error["request_id"] in error["message"]
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)


# -- dependencies -----------------------------------------------------------------------------


def test_another_model_is_a_409_naming_both_and_readyz_503(
    other_tei: LocalTEIServer, make_app: AppFactory
) -> None:
    app = make_app(embed_url=other_tei.url)
    error = assert_error(query(app, {"query": "alpha"}), 409, "fingerprint_mismatch")
    assert "quarry reindex" in error["message"]
    assert error["message"].count("quarry/hash-embedding-32d") == 2  # both models
    ready = assert_error(app.get("/readyz"), 503, "not_ready")
    assert "fingerprint" in ready["message"]
    assert app.get("/readyz").json()["checks"]["fingerprint"]["ok"] is False
    assert app.get("/healthz").status_code == 200


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _poll(app: TestClient, body: dict[str, Any], status: int, seconds: float = 10.0) -> Any:
    """Query until the answer has ``status`` (a dependency restarting may answer 503 between)."""
    deadline = time.monotonic() + seconds
    while True:
        response = query(app, body)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        assert response.status_code in (200, 409, 503), response.text
        time.sleep(0.05)


SWAP_QUERY = {"query": "gamma rays", "rerank": False}


def _answered_then_stopped(
    make_app: AppFactory, **overrides: Any
) -> tuple[TestClient, LocalTEIConfig, LocalTEIConfig]:
    """An app that answered a query from a service now stopped; (app, that service's
    config, the config of another model on the same port)."""
    port = _free_port()
    same = LocalTEIConfig(backend="hash", dims=32, port=port)
    other = LocalTEIConfig(backend="hash", dims=32, seed=7, port=port)
    with LocalTEIServer(same) as server:
        app = make_app(embed_url=server.url, **overrides)
        assert query(app, SWAP_QUERY).status_code == 200
    return app, same, other


def test_a_model_swapped_behind_the_url_is_refused_within_the_recheck(
    make_app: AppFactory,
) -> None:
    app, same, other = _answered_then_stopped(make_app, fingerprint_recheck_seconds=0.2)
    with LocalTEIServer(other):
        assert_error(_poll(app, SWAP_QUERY, 409), 409, "fingerprint_mismatch")
    with LocalTEIServer(same):
        # The model is back: queries are answered again without a /readyz.
        assert _poll(app, SWAP_QUERY, 200).status_code == 200


def test_a_refusal_is_not_served_once_the_embedding_service_is_down(
    make_app: AppFactory,
) -> None:
    app, _, other = _answered_then_stopped(make_app, fingerprint_recheck_seconds=0.3)
    with LocalTEIServer(other):
        assert_error(_poll(app, SWAP_QUERY, 409), 409, "fingerprint_mismatch")
    time.sleep(0.35)  # the refusal is due a recheck, and the service is gone
    assert_error(query(app, SWAP_QUERY), 503, "dependency_unavailable")
    # What it serves is unknown now: a client is told to retry, not to reindex.
    assert_error(query(app, SWAP_QUERY), 503, "dependency_unavailable")


def test_a_model_swapped_in_a_restart_is_refused_at_the_first_query_after_it(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quarry.api as api

    monkeypatch.setattr(api, "EMBED_COOLDOWN_S", 0.0)
    # No recheck comes due in this test: what refuses is the outage seen meanwhile.
    app, _, other = _answered_then_stopped(make_app, fingerprint_recheck_seconds=3600)
    assert_error(query(app, SWAP_QUERY), 503, "dependency_unavailable")  # restarting
    with LocalTEIServer(other):
        error = assert_error(query(app, SWAP_QUERY), 409, "fingerprint_mismatch")
        assert "@72d2634102" in error["message"]  # the model now served


def test_after_an_idle_spell_the_first_query_judges_the_model_before_answering(
    make_app: AppFactory,
) -> None:
    # Swapped while no query came: no outage was seen.
    app, _, other = _answered_then_stopped(make_app, fingerprint_recheck_seconds=0.1)
    with LocalTEIServer(other):
        time.sleep(0.25)  # more than two rechecks: the verdict is too old to answer under
        assert_error(query(app, SWAP_QUERY), 409, "fingerprint_mismatch")


def test_a_restart_that_a_querys_retries_span_is_judged_before_answering(
    make_app: AppFactory,
) -> None:
    import threading

    # Down for a moment only: the query's own retries reach the service back up, as
    # another model. Neither that query nor the next may answer from it.
    app, _, other = _answered_then_stopped(
        make_app, fingerprint_recheck_seconds=3600, retry_budget=5.0
    )
    spanning: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: spanning.update(r=query(app, SWAP_QUERY)))
    thread.start()
    time.sleep(1.0)
    with LocalTEIServer(other):
        thread.join()
        assert_error(spanning["r"], 409, "fingerprint_mismatch")
        assert_error(query(app, SWAP_QUERY), 409, "fingerprint_mismatch")


def test_a_query_vector_of_another_size_is_never_searched_with(
    make_app: AppFactory, tmp_path: Path
) -> None:
    port = _free_port()
    body = {"query": "gamma rays", "rerank": False}
    with ExitStack() as stack:
        server = stack.enter_context(LocalTEIServer(LocalTEIConfig("hash", dims=32, port=port)))
        app = make_app(embed_url=server.url, fingerprint_recheck_seconds=3600)
        assert query(app, body).status_code == 200
        stack.close()
        with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, port=port)):
            error = assert_error(query(app, body), 409, "fingerprint_mismatch")
            assert "qdrant" not in error["message"] and "aligned" not in error["message"]


def _move_alias(app: TestClient, collection: str) -> None:
    """What `quarry reindex` does at its end, done through the app's own local-mode client."""
    from qdrant_client import models

    qdrant = app.app_state["query_service"].store.client._client
    qdrant.update_collection_aliases(
        change_aliases_operations=[
            models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name="test")),
            models.CreateAliasOperation(
                create_alias=models.CreateAlias(collection_name=collection, alias_name="test")
            ),
        ]
    )


def test_an_alias_moved_to_another_models_collection_is_refused_at_once(
    other_tei: LocalTEIServer, template: Path, make_app: AppFactory, tmp_path: Path
) -> None:
    data = tmp_path / "two"
    shutil.copytree(template, data, ignore=shutil.ignore_patterns(".lock"))
    corpus = write_corpus(tmp_path / "corpus", CORPUS)
    moved_to = _build_collection(data, corpus, other_tei.url, collection="other")
    app = make_app(data=data)
    body = {"query": "gamma rays", "rerank": False}
    assert query(app, body).status_code == 200
    _move_alias(app, moved_to)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: query(app, body), range(8)))
    # Every query after the move is refused; none answers with the other model's points.
    for answer in answers:
        assert "quarry reindex" in assert_error(answer, 409, "fingerprint_mismatch")["message"]


def test_a_query_too_long_for_the_reranker_alone_is_a_422(
    short_tei: LocalTEIServer, make_app: AppFactory
) -> None:
    app = make_app(rerank_url=short_tei.url, rerank_required=True)
    long_query = " ".join(["gamma", "rays", "photons", "decay"] * 10)
    error = assert_error(query(app, {"query": long_query}), 422, "query_too_long")
    assert "reranker" in error["message"]
    assert query(app, {"query": long_query, "rerank": False}).status_code == 200
    # Refused after one probe, not after splitting every passage down to nothing.
    assert short_tei.stats.requests[("POST", "/rerank")] <= 4


def test_truncate_also_cuts_a_query_too_long_for_the_reranker(make_app: AppFactory) -> None:
    config = LocalTEIConfig(backend="hash", dims=32, max_input_length=128)
    with LocalTEIServer(config) as reranker:
        app = make_app(rerank_url=reranker.url, rerank_required=True)
        long_query = " ".join(["gamma", "rays", "photons", "decay"] * 40)
        assert 128 < count_tokens(long_query) < 512  # fits the embedder, not the reranker
        assert_error(query(app, {"query": long_query}), 422, "query_too_long")
        cut = query(app, {"query": long_query, "truncate": True})
        assert cut.status_code == 200, cut.text
        assert cut.json()["reranked"] is True and cut.json()["truncated"] is True
        assert cut.json()["results"][0]["uri"] == "corpus/notes/gamma.txt"


def _foreign_collection(data: Path, size: int, payload: dict[str, Any]) -> Path:
    """A collection quarry did not create (no fingerprint), aliased ``test``."""
    from qdrant_client import QdrantClient, models

    (data / "qdrant").mkdir(parents=True)
    client = QdrantClient(path=str(data / "qdrant"))
    params = models.VectorParams(size=size, distance=models.Distance.COSINE)
    client.create_collection("plain", params)
    client.upsert("plain", [models.PointStruct(id=1, vector=[0.1] * size, payload=payload)])
    client.update_collection_aliases(
        change_aliases_operations=[
            models.CreateAliasOperation(
                create_alias=models.CreateAlias(collection_name="plain", alias_name="test")
            )
        ]
    )
    client.close()
    return data


def test_a_foreign_collection_of_another_vector_size_is_a_409(
    make_app: AppFactory, tmp_path: Path, tei: LocalTEIServer
) -> None:
    data = _foreign_collection(tmp_path / "foreign", 8, {"text": "a"})
    store = VectorStore(open_client(Settings(data_dir=data, collection="test")), "test")
    embedder = EmbeddingClient(tei.url, retry=NO_WAIT)
    try:  # `quarry query` (the sync Searcher) refuses it the same way
        with pytest.raises(FingerprintMismatch, match="8-dimensional"):
            Searcher(store, embedder, None).search("alpha")
    finally:
        store.close()
        embedder.close()
    app = make_app(data=data)
    error = assert_error(query(app, {"query": "alpha"}), 409, "fingerprint_mismatch")
    assert "8-dimensional" in error["message"]
    assert app.get("/readyz").json()["checks"]["fingerprint"]["ok"] is False


def test_a_foreign_collections_odd_payload_reads_as_empty_fields(
    make_app: AppFactory, tmp_path: Path
) -> None:
    odd = {"text": "alpha", "chunk_index": "first", "metadata": "m", "headings": "abc"}
    app = make_app(data=_foreign_collection(tmp_path / "foreign", 32, odd))
    response = query(app, {"query": "alpha", "rerank": False})
    assert response.status_code == 200, response.text
    [result] = response.json()["results"]
    assert (result["text"], result["chunk_index"]) == ("alpha", 0)
    assert (result["metadata"], result["headings"]) == ({}, [])


def test_reranker_down_answers_from_vector_scores_with_a_warning(make_app: AppFactory) -> None:
    app = make_app(rerank_url=_dead_url())
    response = query(app, {"query": "gamma rays"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["reranked"] is False
    assert body["results"]
    assert all(result["rerank_score"] is None for result in body["results"])
    assert "rerank failed" in response.headers["warning"]
    assert any("rerank failed" in warning for warning in body["warnings"])
    assert not any("127.0.0.1" in warning for warning in body["warnings"])
    # Queries are answered, so the instance is ready; the check says what is missing.
    ready = app.get("/readyz")
    assert ready.status_code == 200, ready.text
    reranker = ready.json()["checks"]["reranker"]
    assert reranker["ok"] is False and reranker["required"] is False
    assert "vector scores" in reranker["detail"] and "127.0.0.1" not in reranker["detail"]


@pytest.mark.parametrize("required", [False, True])
def test_a_down_reranker_is_not_asked_again_by_every_query(
    make_app: AppFactory, required: bool
) -> None:
    app = make_app(rerank_url=_dead_url(), rerank_required=required)
    reranker = app.app_state["query_service"].reranker
    calls = []
    score = reranker.score

    async def counted(*args: Any, **kwargs: Any) -> list[float]:
        calls.append(args)
        return await score(*args, **kwargs)

    reranker.score = counted
    answers = [query(app, {"query": f"gamma {n}"}) for n in range(3)]
    # The first query found it down; the next ones, within the cooldown, did not ask.
    assert len(calls) == 1
    for answer in answers:
        if required:
            error = assert_error(answer, 503, "dependency_unavailable")
            assert error["dependency"] == "reranker"
        else:
            assert answer.status_code == 200, answer.text
            assert answer.json()["reranked"] is False
            assert "rerank failed" in answer.headers["warning"]


def test_reranker_down_is_a_503_when_rerank_is_required(make_app: AppFactory) -> None:
    app = make_app(rerank_url=_dead_url(), rerank_required=True)
    answer = query(app, {"query": "gamma"})
    error = assert_error(answer, 503, "dependency_unavailable")
    assert error["dependency"] == "reranker"
    assert answer.headers["retry-after"] == "10"  # RERANK_COOLDOWN_S: not asked before
    assert "127.0.0.1" not in error["message"]
    ready = assert_error(app.get("/readyz"), 503, "not_ready")
    assert "reranker" in ready["message"] and "127.0.0.1" not in ready["message"]
    assert app.get("/readyz").json()["checks"]["reranker"]["required"] is True
    # Without rerank the reranker is not needed.
    assert query(app, {"query": "gamma", "rerank": False}).status_code == 200


def test_embedding_service_down_is_a_503_naming_it(make_app: AppFactory) -> None:
    dead = _dead_url()
    app = make_app(embed_url=dead, rerank_url=dead)
    answer = query(app, {"query": "gamma"})
    error = assert_error(answer, 503, "dependency_unavailable")
    assert error["dependency"] == "embedding service"
    assert answer.headers["retry-after"] == "5"  # EMBED_COOLDOWN_S
    assert dead not in error["message"] and "cannot connect" in error["message"]
    # Asked within the cooldown, it says how much of it is left (API trial: always 5).
    time.sleep(2.1)
    later = query(app, {"query": "gamma"})
    assert_error(later, 503, "dependency_unavailable")
    assert 1 <= int(later.headers["retry-after"]) <= 3
    ready = assert_error(app.get("/readyz"), 503, "not_ready")
    assert "embedding" in ready["message"]
    assert app.get("/readyz").json()["checks"]["qdrant"]["ok"] is True


def test_a_down_embedding_service_is_not_asked_again_by_every_query(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quarry.api as api
    from quarry.errors import ServiceUnavailable

    monkeypatch.setattr(api, "EMBED_COOLDOWN_S", 0.3)
    app = make_app(retry_budget=30.0)
    assert query(app, {"query": "gamma"}).status_code == 200  # verified, then the outage
    embedder = app.app_state["query_service"].embedder
    real = embedder.embed_query
    budgets: list[float] = []
    sources: list[str] = []
    url = "http://10.9.8.7:8001/v1/embeddings"

    async def down_once(*args: Any, retry: Any, **kwargs: Any) -> list[float]:
        budgets.append(retry.budget)
        sources.append(retry.budget_source)  # what its retry warning names
        if len(budgets) == 1:
            raise ServiceUnavailable(url, f"still failing after retrying for 5s: {url}: refused")
        return await real(*args, retry=retry, **kwargs)

    embedder.embed_query = down_once
    first = assert_error(query(app, {"query": "gamma"}), 503, "dependency_unavailable")
    # A query waits QUERY_EMBED_RETRY_S at most, not the ingest's QUARRY_RETRY_BUDGET.
    assert budgets == [api.QUERY_EMBED_RETRY_S]
    assert sources == ["a query's cap for the embedding service"]
    assert "10.9.8.7" not in first["message"] and "refused" in first["message"]
    again = assert_error(query(app, {"query": "gamma"}), 503, "dependency_unavailable")
    assert "ago" in again["message"] and "10.9.8.7" not in again["message"]
    assert len(budgets) == 1  # within the cooldown: not asked
    time.sleep(0.35)
    assert query(app, {"query": "gamma"}).status_code == 200
    assert len(budgets) == 2


def test_a_hung_embedding_service_is_a_504_when_the_query_time_runs_out(
    make_app: AppFactory,
) -> None:
    with _silent_url() as silent:
        # Its HTTP timeout (QUARRY_EMBED_TIMEOUT, 60 s) would hold every query a minute.
        app = make_app(embed_url=silent, query_timeout=0.5)
        error = assert_error(query(app, {"query": "gamma"}), 504, "dependency_timeout")
        assert error["dependency"] == "embedding service"
        assert "QUARRY_QUERY_TIMEOUT" in error["message"] and silent not in error["message"]
        # As good as down: the next queries are not held too, within the cooldown.
        again = assert_error(query(app, {"query": "gamma"}), 503, "dependency_unavailable")
        assert "ago" in again["message"] and "QUARRY_QUERY_TIMEOUT" in again["message"]


@pytest.mark.parametrize("after_a_failure", [False, True])
def test_a_burst_on_a_hung_embedding_service_waits_for_one_query_not_for_each(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch, after_a_failure: bool
) -> None:
    import quarry.api as api

    monkeypatch.setattr(api, "EMBED_COOLDOWN_S", 0.3)
    with _silent_url() as silent:
        app = make_app(embed_url=silent, query_timeout=1.0)
        if after_a_failure:  # it hung once; its cooldown is over: one query asks it again
            assert_error(query(app, {"query": "gamma"}), 504, "dependency_timeout")
            time.sleep(0.35)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: query(app, {"query": "gamma"}), range(6)))
    errors = [(a.status_code, a.json()["error"]) for a in answers]
    # The queries that waited behind the one asking are not told Qdrant failed (the
    # query after it may be reading Qdrant when their time runs out).
    assert all(error["dependency"] == "embedding service" for _, error in errors), errors
    if after_a_failure:
        # Known to have failed: only the query that asks it again waits for it; the
        # others are told it is down rather than queueing behind that one.
        assert sorted(status for status, _ in errors) == [503] * 5 + [504], errors


@pytest.mark.parametrize("required", [False, True])
def test_a_hung_reranker_fails_the_rerank_when_the_query_time_runs_out(
    make_app: AppFactory, required: bool
) -> None:
    with _silent_url() as silent:
        app = make_app(rerank_url=silent, rerank_required=required, query_timeout=0.5)
        response = query(app, {"query": "gamma rays"})
        if required:
            error = assert_error(response, 504, "dependency_timeout")
            assert error["dependency"] == "reranker"
            assert silent not in error["message"]
        else:
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["reranked"] is False and body["results"]
            assert "rerank failed" in response.headers["warning"]
            assert any("QUARRY_QUERY_TIMEOUT" in warning for warning in body["warnings"])
        assert query(app, {"query": "gamma", "rerank": False}).status_code == 200


@pytest.mark.parametrize("required", [False, True])
def test_a_hung_reranker_holds_a_query_only_for_the_rerank_timeout_unless_required(
    make_app: AppFactory, required: bool
) -> None:
    with _silent_url() as silent:
        app = make_app(
            rerank_url=silent, rerank_required=required, rerank_timeout=0.2, query_timeout=1.0
        )
        response = query(app, {"query": "gamma rays"})
        if required:  # a required reranker gets the query's whole time
            error = assert_error(response, 504, "dependency_timeout")
            assert "QUARRY_QUERY_TIMEOUT" in error["message"]
        else:
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["reranked"] is False and body["results"]
            assert any("QUARRY_RERANK_TIMEOUT" in warning for warning in body["warnings"])
            # As good as down: the next query does not wait for it.
            again = query(app, {"query": "gamma rays"}).json()
            assert any("ago" in warning for warning in again["warnings"])


def test_after_a_cooldown_one_query_at_a_time_asks_the_dependency_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    import quarry.api as api
    from quarry.api import _Outage
    from quarry.errors import ServiceUnavailable

    clock = [100.0]
    monkeypatch.setattr(api, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    outage = _Outage(cooldown_s=10.0)
    outage.failed(ServiceUnavailable("http://r", "cannot connect"))
    with pytest.raises(ServiceUnavailable, match="asked again 10s after that"):
        outage.check()
    clock[0] += 10.0
    outage.check()  # this caller asks it again...
    with pytest.raises(ServiceUnavailable, match="another query is asking it again"):
        outage.check()  # ...and the others keep the outage meanwhile
    outage.failed(ServiceUnavailable("http://r", "cannot connect"))
    with pytest.raises(ServiceUnavailable, match="asked again"):
        outage.check()
    clock[0] += 10.0
    outage.check()
    outage.abandoned()  # a probe's one attempt failed: says nothing, the next caller asks
    outage.check()
    clock[0] += 10.0  # a caller that vanished holds the turn no longer than a cooldown
    outage.check()
    outage.recovered()
    outage.check()
    outage.check()


def test_a_reranker_back_after_its_cooldown_is_trusted_once_it_answers_even_a_refusal(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import quarry.api as api

    monkeypatch.setattr(api, "RERANK_COOLDOWN_S", 0.3)
    port = _free_port()
    app = make_app(rerank_url=f"http://127.0.0.1:{port}", rerank_required=True)
    assert_error(query(app, {"query": "gamma rays"}), 503, "dependency_unavailable")
    config = LocalTEIConfig(backend="hash", dims=32, max_input_length=128, port=port)
    with LocalTEIServer(config):
        time.sleep(0.4)  # the cooldown is over: the next query asks it again
        long_query = " ".join(["gamma", "rays", "photons", "decay"] * 40)
        assert 128 < count_tokens(long_query) < 512
        # Its first answer is a refusal (too long beside the passages): it is up, and
        # the same query's cut retry is not refused as "another query is asking".
        cut = query(app, {"query": long_query, "truncate": True})
        assert cut.status_code == 200, cut.text
        assert cut.json()["reranked"] is True
        assert query(app, {"query": "gamma rays"}).status_code == 200


def test_a_refused_reranker_fails_readiness_at_once_not_after_the_retry_budget(
    make_app: AppFactory,
) -> None:
    app = make_app(rerank_url=_dead_url(), retry_budget=30.0)
    check = app.get("/readyz").json()["checks"]["reranker"]
    assert check["ok"] is False
    assert "cannot connect" in check["detail"] and "no answer" not in check["detail"]
    # A query waits QUERY_RERANK_RETRY_S (2 s) for it, not the 30 s budget nor its own time.
    body = query(app, {"query": "gamma rays"}).json()
    assert body["reranked"] is False
    assert any("2s" in warning for warning in body["warnings"]), body["warnings"]


@pytest.mark.parametrize("required", [False, True])
def test_readiness_waits_for_a_hung_reranker_only_when_it_counts(
    make_app: AppFactory, monkeypatch: pytest.MonkeyPatch, required: bool
) -> None:
    import asyncio

    import httpx2

    import quarry.api as api
    from quarry._async_clients import AsyncRerankClient

    monkeypatch.setattr(api, "READY_TIMEOUT_S", 2.0)

    async def stuck(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/info":
            return httpx2.Response(404)
        await asyncio.sleep(30)  # a reranker that takes the request and never answers
        return httpx2.Response(500)

    app = make_app(rerank_required=required)
    service = app.app_state["query_service"]
    service.reranker = AsyncRerankClient(
        "http://reranker.test", dialect="tei", transport=httpx2.MockTransport(stuck)
    )
    answer = app.get("/readyz")
    check = answer.json()["checks"]["reranker"]
    assert check["ok"] is False and check["required"] is required
    # A probe (a load balancer's, with a timeout of its own of a second or so) is not
    # held by a reranker that readiness does not count.
    waited = api.READY_TIMEOUT_S if required else api.READY_OPTIONAL_TIMEOUT_S
    assert f"no answer within {waited:g}s" in check["detail"], check
    assert answer.status_code == (503 if required else 200)


def test_a_failed_rerank_reads_the_rerankers_info_again() -> None:
    import asyncio
    import json as jsonlib

    import httpx2

    from quarry._async_clients import AsyncRerankClient
    from quarry.errors import RequestRejected

    limit = [32]
    info_reads = []

    async def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/info":
            info_reads.append(limit[0])
            info = {"model_id": "r", "max_client_batch_size": limit[0], "model_type": {}}
            return httpx2.Response(200, json=info)
        texts = jsonlib.loads(await request.aread())["texts"]
        if len(texts) > limit[0]:
            message = f"batch size {len(texts)} > maximum allowed batch size {limit[0]}"
            return httpx2.Response(422, json={"error": message, "error_type": "Validation"})
        return httpx2.Response(200, json=[{"index": i, "score": 0.5} for i in range(len(texts))])

    async def main() -> None:
        client = AsyncRerankClient(
            "http://tei", dialect="tei", transport=httpx2.MockTransport(handler), retry=NO_WAIT
        )
        try:
            assert len(await client.score("q", ["a"] * 6)) == 6
            limit[0] = 4  # restarted with a smaller batch limit
            with pytest.raises(RequestRejected):
                await client.score("q", ["a"] * 6)
            assert len(await client.score("q", ["a"] * 6)) == 6  # in batches of 4 now
            assert info_reads == [32, 4]
        finally:
            await client.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_hung_info_route_fails_within_the_retry_budget_not_the_http_timeout() -> None:
    import asyncio

    from quarry._async_clients import AsyncRerankClient
    from quarry._http import RetryPolicy
    from quarry.errors import ServiceUnavailable

    # The HTTP timeout (QUARRY_EMBED_TIMEOUT, 60 s) is sized for embedding a batch;
    # a reranker whose /info hangs would otherwise hold every score() that long.
    policy = RetryPolicy(budget=1.0, initial=0.01, maximum=0.01)
    with _silent_url() as silent:

        async def main() -> None:
            client = AsyncRerankClient(silent, timeout=60.0, retry=policy)
            try:
                with pytest.raises(ServiceUnavailable, match="timed out"):
                    await client.info()
            finally:
                await client.aclose()

        asyncio.run(asyncio.wait_for(main(), 10))
        sync = EmbeddingClient(silent, timeout=60.0, retry=policy)
        with ThreadPoolExecutor(1) as pool, pytest.raises(ServiceUnavailable, match="timed out"):
            pool.submit(lambda: sync.info).result(timeout=10)
        sync.close()


def test_a_failure_on_one_input_starts_no_cooldown(make_app: AppFactory) -> None:
    from quarry.errors import ServiceUnavailable

    app = make_app()
    assert query(app, {"query": "gamma"}).status_code == 200
    embedder = app.app_state["query_service"].embedder
    real = embedder.embed_query

    async def fails_on_poison(query_text: str, **kwargs: Any) -> list[float]:
        if "poison" in query_text:  # the model fails on this input (TEI: 424)
            raise ServiceUnavailable("http://tei/v1/embeddings", "Inference failed", status=424)
        return await real(query_text, **kwargs)

    embedder.embed_query = fails_on_poison
    assert_error(query(app, {"query": "poison"}), 503, "dependency_unavailable")
    # The next query is answered: the service was up all along.
    assert query(app, {"query": "gamma"}).status_code == 200


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            "still failing after retrying for 2s: http://10.0.0.5:8013/info: cannot connect",
            "still failing after retrying for 2s: cannot connect",
        ),
        ("HTTP 500 from https://tei.internal/rerank (see logs)", "HTTP 500 from <service URL> (see logs)"),
        ("HTTP 500 from http://[fd00::5]:8013/rerank (see logs)", "HTTP 500 from <service URL> (see logs)"),
    ],
)  # fmt: skip
def test_errors_sent_to_clients_carry_no_service_url(message: str, reason: str) -> None:
    from quarry.api import _reason
    from quarry.errors import ServiceUnavailable

    assert _reason(ServiceUnavailable("http://10.0.0.5:8013/rerank", message)) == reason


def test_qdrant_down_is_a_503_naming_it(make_app: AppFactory) -> None:
    app = make_app(qdrant_url=_dead_url())
    error = assert_error(query(app, {"query": "gamma"}), 503, "dependency_unavailable")
    assert error["dependency"] == "qdrant"
    assert_error(app.get("/v1/collections", headers=AUTH), 503, "dependency_unavailable")
    ready = app.get("/readyz")
    assert "qdrant" in assert_error(ready, 503, "not_ready")["message"]
    assert ready.json()["checks"]["embedding"]["ok"] is True


def test_a_missing_collection_is_a_503_that_says_to_ingest(
    make_app: AppFactory, tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    app = make_app(data=tmp_path / "empty")
    error = assert_error(query(app, {"query": "gamma"}), 503, "collection_not_found")
    assert "quarry ingest" in error["message"]
    assert_error(app.get("/readyz"), 503, "not_ready")


def test_a_physical_collection_set_as_the_alias_is_named_as_such(
    make_app: AppFactory, template: Path
) -> None:
    # Review: the CLI refused it with the alias to pass; the API said to ingest.
    store = VectorStore(open_client(Settings(data_dir=template, collection="test")), "test")
    try:
        physical = store.alias_target()
    finally:
        store.close()
    assert physical is not None
    app = make_app(collection=physical)
    error = assert_error(query(app, {"query": "gamma"}), 503, "collection_not_found")
    assert "is a collection, not an alias" in error["message"]
    assert "--collection test" in error["message"]


def test_a_locked_local_store_stops_startup_with_quarrys_message(
    template: Path, tei: LocalTEIServer, tmp_path: Path
) -> None:
    data = tmp_path / "locked"
    shutil.copytree(template, data, ignore=shutil.ignore_patterns(".lock"))
    settings = Settings(data_dir=data, collection="test", embed_url=tei.url)
    holder = open_client(settings)  # an ingest, say, holds the folder
    try:
        with pytest.raises(StoreLocked, match="QUARRY_QDRANT_URL"):
            with TestClient(create_app(settings)):
                pass
    finally:
        holder.close()


def test_serve_stops_with_the_store_locked_error(
    template: Path, tei: LocalTEIServer, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`quarry api` raises the QuarryError that stopped startup, logged as one clear line."""
    data = tmp_path / "locked"
    shutil.copytree(template, data, ignore=shutil.ignore_patterns(".lock"))
    settings = Settings(data_dir=data, collection="test", embed_url=tei.url)
    holder = open_client(settings)
    try:
        with pytest.raises(StoreLocked, match="admits one process"):
            serve(settings, "127.0.0.1", 0)
    finally:
        holder.close()
    log = capfd.readouterr().err  # uvicorn's own log handler writes to stderr
    assert "quarry api cannot start: local-mode Qdrant at " in log
    assert "Traceback" not in log


def test_readyz_and_collections_when_all_is_well(app: TestClient) -> None:
    ready = app.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "ready"
    assert set(ready.json()["checks"]) == {"qdrant", "embedding", "reranker", "fingerprint"}
    listing = app.get("/v1/collections", headers=AUTH).json()
    assert listing["alias"] == "test"
    (entry,) = listing["collections"]
    assert entry["active"] is True
    assert entry["aliases"] == ["test"]
    assert entry["points"] > len(CORPUS)
    assert entry["name"].startswith(f"test__{entry['model']['model_key']}__")


def test_openapi_documents_examples_and_the_error_shape(app: TestClient) -> None:
    schema = app.get("/openapi.json").json()
    operation = schema["paths"]["/v1/query"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["examples"]
    assert set(operation["responses"]) >= {"200", "401", "409", "413", "422", "503", "504"}
    error_ref = operation["responses"]["422"]["content"]["application/json"]["schema"]["$ref"]
    assert error_ref.endswith("/ErrorBody")
    assert "HTTPValidationError" not in json.dumps(schema)
    assert schema["components"]["securitySchemes"]["QuarryApiKey"]["scheme"] == "bearer"
    for path, method in (("/v1/query", "post"), ("/v1/collections", "get")):
        assert schema["paths"][path][method]["security"] == [{"QuarryApiKey": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]


# -- client pieces ----------------------------------------------------------------------------


def test_concurrent_rerank_clients_share_one_info_fetch_under_the_callers_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    import quarry._async_clients as clients
    from quarry._async_clients import AsyncRerankClient
    from quarry._http import RetryPolicy
    from quarry.errors import ServiceUnavailable

    budgets: list[float] = []

    async def down(_http: Any, url: str, policy: RetryPolicy) -> None:
        budgets.append(policy.budget)
        await asyncio.sleep(0.05)
        raise ServiceUnavailable(url, "down")

    monkeypatch.setattr(clients, "afetch_info", down)

    async def main() -> list[BaseException | list[float]]:
        client = AsyncRerankClient("http://127.0.0.1:9", retry=RetryPolicy(budget=30.0))
        try:
            short = RetryPolicy(budget=2.0)
            return await asyncio.gather(
                *(client.score("q", ["a"], retry=short) for _ in range(4)),
                return_exceptions=True,
            )
        finally:
            await client.aclose()

    outcomes = asyncio.run(main())
    assert all(isinstance(outcome, ServiceUnavailable) for outcome in outcomes)
    assert budgets == [2.0]  # one fetch for the four, under the query's budget


def test_input_slots_cap_what_is_in_flight_first_come_first_served() -> None:
    import asyncio

    from quarry._async_clients import InputSlots

    slots = InputSlots()
    in_flight = peak = 0
    order: list[str] = []

    async def use(name: str, count: int, hold: float) -> None:
        nonlocal in_flight, peak
        async with slots.hold(count, 4, url="http://tei", wait_s=10.0):
            order.append(name)
            in_flight += min(count, 4)
            peak = max(peak, in_flight)
            await asyncio.sleep(hold)
            in_flight -= min(count, 4)

    async def main() -> None:
        first = asyncio.create_task(use("a", 3, 0.05))
        await asyncio.sleep(0)
        # b (2) does not fit beside a (3); c (1) would, but it queued after b.
        rest = [asyncio.create_task(use(n, k, 0.01)) for n, k in (("b", 2), ("c", 1))]
        cancelled = asyncio.create_task(use("x", 2, 0.01))
        big = asyncio.create_task(use("big", 10, 0.01))  # over the limit: runs alone
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(first, *rest, big)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        async with slots.hold(4, 4, url="http://tei", wait_s=0.0):  # nothing leaked
            pass

    asyncio.run(asyncio.wait_for(main(), 10))
    assert order == ["a", "b", "c", "big"]
    assert peak <= 4


def test_a_busy_reranker_is_waited_for_not_taken_for_down() -> None:
    import asyncio

    from quarry._async_clients import AsyncEmbeddingClient, AsyncRerankClient
    from quarry._http import RetryPolicy

    # TEI takes a permit per input and answers 429 at once when none is free: 12
    # queries of 8 passages (96 inputs) against 8 permits. The clients must queue
    # for room, not send what TEI would refuse.
    policy = RetryPolicy(budget=20.0, initial=0.0, maximum=0.0, jitter=0.0)
    config = LocalTEIConfig(
        backend="hash", dims=8, max_concurrent_requests=8, max_client_batch_size=4,
        latency_ms=20.0,
    )  # fmt: skip
    with LocalTEIServer(config) as tei:

        async def main() -> tuple[list[list[float]], list[list[float]]]:
            reranker = AsyncRerankClient(tei.url, retry=policy)
            embedder = AsyncEmbeddingClient(tei.url, retry=policy)
            try:
                passages = [f"passage {i} about topic {i % 3}" for i in range(8)]
                scores = await asyncio.gather(
                    *(reranker.score(f"query {q}", passages) for q in range(12))
                )
                vectors = await asyncio.gather(
                    *(embedder.embed_query(f"query {q}") for q in range(24))
                )
                return scores, vectors
            finally:
                await reranker.aclose()
                await embedder.aclose()

        scores, vectors = asyncio.run(main())
        assert tei.stats.responses.get(429, 0) == 0
        assert tei.stats.peak_in_flight <= 8
    assert [len(s) for s in scores] == [8] * 12
    assert len(vectors) == 24 and all(len(v) == 8 for v in vectors)


def test_a_reranker_with_fewer_permits_than_its_batch_size_still_scores() -> None:
    import asyncio

    from quarry._async_clients import AsyncRerankClient

    config = LocalTEIConfig(backend="hash", dims=8, max_concurrent_requests=4)
    with LocalTEIServer(config) as tei:

        async def main() -> list[float]:
            reranker = AsyncRerankClient(tei.url)
            try:
                return await reranker.score("q", [f"passage {i}" for i in range(10)])
            finally:
                await reranker.aclose()

        assert len(asyncio.run(main())) == 10
        assert tei.stats.responses.get(429, 0) == 0


def test_input_slots_wait_no_longer_than_the_budget() -> None:
    import asyncio

    from quarry._async_clients import InputSlots
    from quarry.errors import ServiceUnavailable

    slots = InputSlots()

    async def main() -> ServiceUnavailable:
        held = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            async with slots.hold(4, 4, url="http://tei", wait_s=1.0):
                held.set()
                await release.wait()

        task = asyncio.create_task(holder())
        await held.wait()
        with pytest.raises(ServiceUnavailable) as busy:
            async with slots.hold(1, 4, url="http://tei", wait_s=0.05):
                pass
        release.set()
        await task
        async with slots.hold(4, 4, url="http://tei", wait_s=0.0):  # nothing leaked
            pass
        return busy.value

    error = asyncio.run(asyncio.wait_for(main(), 10))
    assert error.status == 429 and "max_concurrent_requests (4)" in str(error)


def test_one_failed_rerank_batch_cancels_the_others() -> None:
    import asyncio
    import json as jsonlib

    import httpx2

    from quarry._async_clients import AsyncRerankClient
    from quarry.errors import RequestRejected

    cancelled: list[str] = []
    sent: list[str] = []

    async def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/info":
            return httpx2.Response(404)
        texts = jsonlib.loads(await request.aread())["texts"]
        sent.extend(texts)
        if texts == ["bad"]:
            return httpx2.Response(400, json={"error": "no", "error_type": "Validation"})
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.extend(texts)
            raise
        return httpx2.Response(200, json=[{"index": 0, "score": 0.5}])

    async def main() -> None:
        client = AsyncRerankClient(
            "http://tei", dialect="tei", batch_size=1, transport=httpx2.MockTransport(handler)
        )
        try:
            with pytest.raises(RequestRejected):
                await client.score("q", ["slow", "bad", "slower"])
            # Cancelled by score() itself, before it raised (not at the loop's shutdown):
            # in flight, or (after the failure made it read /info again) before being sent.
            assert "slow" in cancelled
            assert sorted(cancelled) == sorted(text for text in sent if text != "bad")
        finally:
            await client.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_local_qdrant_is_opened_on_the_thread_that_uses_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import asyncio

    from qdrant_client.local.persistence import CollectionPersistence

    from quarry._async_clients import ThreadedLocalQdrant

    _foreign_collection(tmp_path / "data", 8, {"text": "a"})
    # As on a platform whose SQLite refuses a connection used by another thread.
    monkeypatch.setattr(CollectionPersistence, "CHECK_SAME_THREAD", True)

    async def main() -> int:
        client = ThreadedLocalQdrant(str(tmp_path / "data" / "qdrant"))
        try:
            return (await client.count("plain", exact=True)).count
        finally:
            await client.close()

    assert asyncio.run(main()) == 1


@pytest.mark.parametrize(
    ("value", "index"), [(3, 3), ("4", 4), ("--5", 0), ("\u00b2", 0), (True, 0), (None, 0)]
)
def test_a_payloads_chunk_index_of_any_type_reads_as_an_int(value: Any, index: int) -> None:
    from qdrant_client import models

    from quarry.search import result_from_point

    point = models.ScoredPoint(id=1, version=0, score=0.5, payload={"chunk_index": value})
    assert result_from_point(point, None).chunk_index == index


def test_served_app_freezes_what_startup_loaded(
    tmp_path: Path, template: Path, tei: LocalTEIServer
) -> None:
    # `quarry api` (serve) builds the app with freeze_heap: the collection loaded at startup
    # is then never walked by a full collection, which stalled queries for 0.3 s.
    import gc

    shutil.copytree(template, tmp_path / "data", ignore=shutil.ignore_patterns(".lock"))
    settings = Settings(
        data_dir=tmp_path / "data", collection="test", embed_url=tei.url, api_key=SecretStr(KEY)
    )
    assert gc.get_freeze_count() == 0
    try:
        with TestClient(create_app(settings, freeze_heap=True)) as app:
            assert gc.get_freeze_count() > 10_000
            assert query(app, {"query": "gamma rays"}).status_code == 200
    finally:
        gc.unfreeze()
    with TestClient(create_app(settings)) as app:
        assert gc.get_freeze_count() == 0


# -- the query's time (QUARRY_QUERY_TIMEOUT) ---------------------------------------------------


def test_a_504_message_is_as_documented_and_the_log_names_the_url(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with _silent_url() as silent:
        app = make_app(embed_url=silent, query_timeout=0.5)
        caplog.set_level(logging.WARNING, logger="quarry.api")
        error = assert_error(query(app, {"query": "gamma"}), 504, "dependency_timeout")
        # The form the OpenAPI example (_ERR_504) documents.
        assert error["message"] == (
            "embedding service did not answer: no answer within the query's 0.5s "
            "(QUARRY_QUERY_TIMEOUT)"
        )
        # The client is not told where the service is; the server's log is.
        said = [r.getMessage() for r in caplog.records if "did not answer" not in r.getMessage()]
        assert any(f"embedding service failed: {silent}" in line for line in said), said


def test_a_burst_queued_on_a_busy_embedding_service_does_not_mark_it_down(
    make_app: AppFactory, template: Path
) -> None:
    # A healthy service with one permit and 300 ms per request: a burst of 8 queries
    # queues in the API (InputSlots) and the last ones run out of their query time
    # while waiting their turn. The service answered everything it was sent.
    config = LocalTEIConfig(backend="hash", dims=32, max_concurrent_requests=1, latency_ms=300.0)
    with LocalTEIServer(config) as busy:
        app = make_app(embed_url=busy.url, query_timeout=1.5, retry_budget=5.0)
        body = {"query": "gamma rays", "rerank": False}
        with ThreadPoolExecutor(8) as pool:
            statuses = sorted(r.status_code for r in pool.map(lambda _: query(app, body), range(8)))
        assert 200 in statuses and 504 in statuses, statuses  # some answered, some ran out
        # Only answers and timeouts: no query was told the service is down (503). A
        # query cancelled at its deadline frees its slot while the service still
        # works on it, so the next one can meet a 429; the client retries that.
        assert set(statuses) == {200, 504}, statuses
        # The burst is over and the service is idle and answering: a query is answered.
        after = query(app, body)
        assert after.status_code == 200, after.text


class _InfoHangsAfterStartup:
    """A loopback proxy to a real TEI whose GET /info hangs after its first answer
    (or, with ``delay_s``, answers that much later)."""

    def __init__(self, upstream: str, delay_s: float | None = None) -> None:
        import http.server
        import threading
        import urllib.request

        self.release = threading.Event()
        infos = [0]
        release = self.release

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                if self.command == "GET" and self.path == "/info":
                    infos[0] += 1
                    if infos[0] > 1:
                        released = release.wait(30 if delay_s is None else delay_s)
                        if delay_s is None or released:
                            return
                content_type = self.headers.get("Content-Type", "application/json")
                request = urllib.request.Request(
                    upstream + self.path,
                    data=data,
                    method=self.command,
                    headers={"Content-Type": content_type},
                )
                try:
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        status, payload = answer.status, answer.read()
                except urllib.error.HTTPError as error:
                    status, payload = error.code, error.read()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_query_waiting_on_the_recheck_is_not_blamed_on_qdrant(
    other_tei: LocalTEIServer,
    template: Path,
    make_app: AppFactory,
    tmp_path: Path,
    tei: LocalTEIServer,
) -> None:
    data = tmp_path / "two"
    shutil.copytree(template, data, ignore=shutil.ignore_patterns(".lock"))
    corpus = write_corpus(tmp_path / "corpus", CORPUS)
    moved_to = _build_collection(data, corpus, other_tei.url, collection="other")
    proxy = _InfoHangsAfterStartup(tei.url)
    try:
        app = make_app(
            data=data, embed_url=proxy.url, query_timeout=1.0, fingerprint_recheck_seconds=0.01
        )
        _move_alias(app, moved_to)
        time.sleep(0.05)  # the verdict is now due for its recheck
        # The query starts the recheck (which holds the lock while /info hangs), finds
        # the other model's points and waits for the lock to judge the collection again.
        response = query(app, {"query": "gamma rays", "rerank": False})
        error = assert_error(response, 504, "dependency_timeout")
        # Qdrant answered every call; the embedding service's /info is what hung.
        assert error["dependency"] != "qdrant", error
    finally:
        proxy.close()


def test_readyz_gives_a_slow_info_the_time_it_promises(
    make_app: AppFactory, tei: LocalTEIServer
) -> None:
    # Review: a probe's single attempt read /info for 1 s, not READY_TIMEOUT_S (5 s),
    # so a replica answering every query was taken out of its load balancer.
    proxy = _InfoHangsAfterStartup(tei.url, delay_s=1.5)
    try:
        app = make_app(embed_url=proxy.url)
        ready = app.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["embedding"]["ok"] is True
    finally:
        proxy.close()


def test_a_background_recheck_logs_under_no_requests_id(
    make_app: AppFactory, tei: LocalTEIServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Review: the recheck a query started copied that query's request id into its own
    # failure's log lines, long after the query had been answered.
    caplog.set_level(logging.WARNING, logger="quarry.api")
    proxy = _InfoHangsAfterStartup(tei.url)
    try:
        app = make_app(embed_url=proxy.url, query_timeout=0.5, fingerprint_recheck_seconds=1.0)
        # The verdict is due for its recheck (not yet two old, which the query would
        # judge itself): this query starts it in the background.
        time.sleep(1.3)
        answered = query(app, {"query": "gamma rays", "rerank": False})
        assert answered.status_code == 200, answered.text
        request_id = answered.headers["X-Request-ID"]
        deadline = time.monotonic() + 10
        while not any("fingerprint recheck" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the recheck never failed"
            time.sleep(0.05)
    finally:
        proxy.close()
    recheck = [r.getMessage() for r in caplog.records if "request_id=" in r.getMessage()]
    assert recheck, caplog.text  # the failure is logged with a request id field ...
    assert not any(request_id in line for line in recheck), recheck  # ... not the query's
