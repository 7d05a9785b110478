"""A document of many chunks is embedded and written a window at a time.

Against a real local_tei (hash backend) and local-mode Qdrant, with the window made
small so that a document of a few dozen chunks is "long".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import quarry.ingest
from quarry.documents import STAMP_FIELDS
from quarry.embeddings import EmbeddingClient, EmbedFailure, EmbedResult
from quarry.errors import RequestRejected, ServiceUnavailable
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from quarry.store import VectorStore, open_client
from tests.conftest import write_corpus
from tests.test_ingest import Harness, _chunk_vectors

WINDOW = 8
PARAGRAPHS = [
    f"Paragraph {i} tells of quarry number {i}: granite cut in terraces, "
    f"then flooded when the pumps stopped in the year {1900 + i}. " * 2
    for i in range(48)
]
LONG_TEXT = "# Quarries\n\n" + "\n\n".join(PARAGRAPHS) + "\n"


@pytest.fixture(scope="module")
def tei() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32)) as server:
        yield server


@pytest.fixture
def windowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quarry.ingest, "LONG_DOCUMENT_CHUNKS", WINDOW)
    monkeypatch.setattr(quarry.ingest, "LONG_DOCUMENT_WINDOW", WINDOW)


def _harness(tmp_path: Path, url: str, text: str = LONG_TEXT) -> Harness:
    harness = Harness(tmp_path, url)
    harness.root = write_corpus(tmp_path / "long", {"long.md": text})
    return harness


def _assert_as_written_whole(
    harness: Harness, folder: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness's points are those one write of the whole document makes."""
    with monkeypatch.context() as whole:
        whole.setattr(quarry.ingest, "LONG_DOCUMENT_CHUNKS", 10**9)
        rebuilt = Harness(folder, url)
        rebuilt.root = harness.root
        rebuilt.run()
    kept, fresh = _chunk_vectors(harness), _chunk_vectors(rebuilt)
    assert kept.keys() == fresh.keys()
    for key, (payload, vector) in kept.items():
        assert _lasting(payload) == _lasting(fresh[key][0]), key
        assert vector == pytest.approx(fresh[key][1], abs=1e-6), key


def _lasting(payload: dict[str, Any]) -> dict[str, Any]:
    """A payload less when it was written and when its file was read."""
    out = {k: v for k, v in payload.items() if k != "ingested_at"}
    out["metadata"] = {k: v for k, v in payload["metadata"].items() if k not in STAMP_FIELDS}
    return out


def _edit(harness: Harness, tei: LocalTEIServer, text: str) -> Any:
    """Write ``text`` as the long document and sync it: one document, written whole,
    and every input the service embedded counted (the canary aside)."""
    (harness.root / "long.md").write_text(text)
    tei.stats.reset()
    edited = harness.run()
    assert edited.failures == [] and edited.documents_embedded == 1
    assert tei.stats.inputs_embedded == edited.chunks_embedded + 1  # and the canary
    assert _complete(harness)
    return edited


def _complete(harness: Harness) -> bool:
    store = VectorStore(open_client(harness.settings), "test")
    try:
        (state,) = store.index_state().values()
        return state.is_complete()
    finally:
        store.close()


def _record_calls(
    monkeypatch: pytest.MonkeyPatch,
    before_embed: Callable[[int], None] = lambda n: None,
) -> list[str]:
    """Note each embed_passages call and each upsert, in order; ``before_embed`` is
    called with the embed call's number first (to make one fail)."""
    events: list[str] = []
    embed, upsert = EmbeddingClient.embed_passages, VectorStore.upsert

    def recording_embed(
        self: EmbeddingClient, texts: Sequence[str], **kw: Any
    ) -> list[EmbedResult]:
        events.append("embed")
        before_embed(events.count("embed"))
        return embed(self, texts, **kw)

    def recording_upsert(self: VectorStore, points: Sequence[Any], physical: Any = None) -> None:
        events.append("upsert")
        upsert(self, points, physical)

    monkeypatch.setattr(EmbeddingClient, "embed_passages", recording_embed)
    monkeypatch.setattr(VectorStore, "upsert", recording_upsert)
    return events


def test_a_long_document_is_written_as_it_is_embedded_and_as_one_write_would(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = _harness(tmp_path, tei.url)
    with monkeypatch.context() as patch:
        events = _record_calls(patch)
        report = harness.run()
    assert report.failures == [] and report.documents_embedded == 1
    assert report.chunks_embedded > 3 * WINDOW
    # Writes begin before the last window is embedded: not every vector is held at once.
    assert events.index("upsert") < len(events) - 1 - events[::-1].index("embed")
    assert _complete(harness)
    _assert_as_written_whole(harness, tmp_path / "whole", tei.url, monkeypatch)


def test_a_long_document_cut_off_half_way_is_finished_by_the_next_run_reusing_its_start(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = _harness(tmp_path, tei.url)

    def service_goes_down(call: int) -> None:
        if call == 3:
            raise ServiceUnavailable(tei.url, "connection refused")

    with monkeypatch.context() as patch:
        _record_calls(patch, service_goes_down)
        with pytest.raises(ServiceUnavailable):
            harness.run()
    assert len(harness.points()) == 2 * WINDOW  # two windows written
    assert not _complete(harness)  # read as unfinished, so the next run writes it
    tei.stats.reset()
    report = harness.run()
    assert report.documents_embedded == 1
    assert report.chunks_reused == 2 * WINDOW
    assert tei.stats.inputs_embedded == report.chunks_embedded + 1  # and the canary
    assert _complete(harness)
    _assert_as_written_whole(harness, tmp_path / "whole", tei.url, monkeypatch)


def test_an_edit_to_a_long_document_re_embeds_only_the_chunks_it_changed(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = _harness(tmp_path, tei.url)
    first = harness.run()
    paragraphs = list(PARAGRAPHS)
    paragraphs[30] = "A new paragraph, written over quarry thirty's story."
    edited = _edit(harness, tei, "# Quarries\n\n" + "\n\n".join(paragraphs) + "\n")
    assert 0 < edited.chunks_embedded <= 3
    assert edited.chunks_reused >= first.chunks_embedded - 4
    _assert_as_written_whole(harness, tmp_path / "whole", tei.url, monkeypatch)


def test_chunks_inserted_near_the_top_of_a_long_document_move_the_rest_without_re_embedding(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More new chunks than a window: each window then overwrites points whose vectors
    # the next window reuses, unless they are read before.
    harness = _harness(tmp_path, tei.url)
    harness.run()
    inserted = [f"An inserted paragraph {i} about the pumping station. " * 3 for i in range(12)]
    edited = _edit(harness, tei, "# Quarries\n\n" + "\n\n".join(inserted + PARAGRAPHS) + "\n")
    assert edited.chunks_embedded <= len(inserted) + 2, edited
    assert edited.chunks_reused >= len(PARAGRAPHS) - 2
    _assert_as_written_whole(harness, tmp_path / "whole", tei.url, monkeypatch)


def test_a_shorter_long_document_loses_the_chunks_past_its_end(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = _harness(tmp_path, tei.url)
    first = harness.run()
    (harness.root / "long.md").write_text("# Quarries\n\n" + "\n\n".join(PARAGRAPHS[:30]) + "\n")
    shorter = harness.run()
    assert shorter.chunks_deleted == first.chunks_embedded - len(harness.points()) > 0
    assert _complete(harness)
    _assert_as_written_whole(harness, tmp_path / "whole", tei.url, monkeypatch)


def test_a_chunk_rejected_in_a_later_window_fails_the_document_naming_it(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = _harness(tmp_path, tei.url)
    embed = EmbeddingClient.embed_passages

    def rejecting(self: EmbeddingClient, texts: Sequence[str], **kw: Any) -> list[EmbedResult]:
        calls.append(1)
        if len(calls) == 3:
            error = RequestRejected(tei.url, "rejected", status=400, documents=kw["documents"][:1])
            return [EmbedFailure(error) for _ in texts]
        return embed(self, texts, **kw)

    calls: list[int] = []
    with monkeypatch.context() as patch:
        patch.setattr(EmbeddingClient, "embed_passages", rejecting)
        report = harness.run()
    (failure,) = report.failures
    assert failure.uri == "long/long.md"
    assert f"its first {2 * WINDOW} chunks were written" in failure.error
    assert not _complete(harness)
    again = harness.run()
    assert again.failures == [] and again.chunks_reused == 2 * WINDOW
    _assert_as_written_whole(harness, tmp_path / "whole", tei.url, monkeypatch)


def test_a_long_document_whose_chunks_the_service_splits_counts_every_part(
    tmp_path: Path, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, max_input_length=40)) as server:
        harness = _harness(tmp_path, server.url)
        report = harness.run()
        points = [p["payload"] for p in harness.points().values()]
        assert any(p["token_count"] is None for p in points)  # parts of split chunks
        assert report.failures == [] and _complete(harness)
        assert {p["chunk_count"] for p in points} == {len(points)}
        _assert_as_written_whole(harness, tmp_path / "whole", server.url, monkeypatch)


def test_a_long_document_split_by_the_service_and_cut_off_reads_unfinished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every chunk comes back in two parts, so the first window alone makes as many
    # points as the document has chunks: counted by chunks, it would read as complete.
    monkeypatch.setattr(quarry.ingest, "LONG_DOCUMENT_CHUNKS", 12)
    monkeypatch.setattr(quarry.ingest, "LONG_DOCUMENT_WINDOW", 12)
    paragraphs = [
        f"Paragraph {i} tells of quarry number {i}: granite cut in terraces, "
        "then flooded when the pumps stopped. " * 2
        for i in range(24)
    ]
    text = "# Quarries\n\n" + "\n\n".join(paragraphs) + "\n"
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, max_input_length=40)) as server:
        harness = _harness(tmp_path, server.url, text)

        def service_goes_down(call: int) -> None:
            if call == 2:
                raise ServiceUnavailable(server.url, "connection refused")

        with monkeypatch.context() as patch:
            _record_calls(patch, service_goes_down)
            with pytest.raises(ServiceUnavailable):
                harness.run()
        assert len(harness.points()) == 24  # 12 chunks in 24 parts, of 24 chunks
        assert not _complete(harness)
        report = harness.run()
        assert report.documents_embedded == 1 and _complete(harness)
        _assert_as_written_whole(harness, tmp_path / "whole", server.url, monkeypatch)


def test_progress_counts_a_long_document_s_chunks_as_its_windows_are_written(
    tmp_path: Path, tei: LocalTEIServer, windowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from quarry.ingest import IndexSync, IngestProgress

    monkeypatch.setattr(quarry.ingest, "PROGRESS_TICK_SECONDS", 0.02)
    harness = _harness(tmp_path, tei.url)
    seen: list[IngestProgress] = []
    embed = EmbeddingClient.embed_passages

    def slow_embed(self: EmbeddingClient, texts: Sequence[str], **kw: Any) -> list[EmbedResult]:
        time.sleep(0.2)  # a window long enough for the run to say how far it has got
        return embed(self, texts, **kw)

    monkeypatch.setattr(EmbeddingClient, "embed_passages", slow_embed)
    with ThreadPoolExecutor(1) as pool:

        def in_a_thread(sync: IndexSync, documents: list[Any]) -> Any:
            return pool.submit(sync.write_batch, documents)

        report = harness.run(submit=in_a_thread, progress=seen.append)
    during = {p.chunks_embedded for p in seen if p.files_done == 0}
    assert any(0 < chunks < report.chunks_embedded for chunks in during), during
    told = [p.chunks_embedded for p in seen]
    assert told == sorted(told) and told[-1] == report.chunks_embedded
