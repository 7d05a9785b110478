"""Blue/green reindex, rollback, prune and parity, with real local_tei instances:
two seeds model a model change; another reported version models an engine change."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import models

from quarry._http import NO_WAIT
from quarry.chunking import Chunker
from quarry.config import Settings
from quarry.embeddings import EmbeddingClient
from quarry.errors import (
    ConfigError,
    FingerprintMismatch,
    MassDeleteRefused,
    Refused,
    ServiceError,
    ServingChanged,
    StoreError,
)
from quarry.ingest import IndexSync, run_sync
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from quarry.parity import accept, measure_parity
from quarry.prompts import ProfileName
from quarry.reindex import (
    BUILDING,
    COMPLETE,
    INTERRUPTED_WRITE,
    META_BUILD,
    REFUSED,
    VERIFY_SAMPLE,
    prune,
    reindex,
    rollback,
    verify,
)
from quarry.search import Searcher
from quarry.sources import open_source
from quarry.store import META_CHUNKING, META_FINGERPRINT, VectorStore, open_client
from tests.conftest import fail_listing, recording_deletes, write_corpus

CORPUS = {
    f"topic{i}.md": f"# Topic {i}\n\n" + f"Facts about subject number {i}. " * (20 + 5 * i)
    for i in range(8)
}


@pytest.fixture(scope="module")
def old_model() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=24, seed=0)) as server:
        yield server


@pytest.fixture(scope="module")
def new_model() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=32, seed=5)) as server:
        yield server


@pytest.fixture(scope="module")
def upgraded_engine() -> Iterator[LocalTEIServer]:
    config = LocalTEIConfig(backend="hash", dims=24, seed=0, engine_version="2.0.0")
    with LocalTEIServer(config) as server:
        yield server


class Index:
    def __init__(self, tmp_path: Path) -> None:
        self.settings = Settings(data_dir=tmp_path / "data", collection="kb")
        self.corpus = write_corpus(tmp_path / "corpus", CORPUS)
        self.store = VectorStore(open_client(self.settings), "kb")
        self.clients: list[EmbeddingClient] = []

    def embedder(self, url: str) -> EmbeddingClient:
        client = EmbeddingClient(url, retry=NO_WAIT)
        self.clients.append(client)
        return client

    def sync(self, url: str, store: VectorStore | None = None) -> IndexSync:
        return IndexSync(store or self.store, self.embedder(url), Chunker(64, 8))

    def ingest(self, url: str) -> None:
        run_sync(self.sync(url), [open_source(self.corpus)])

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.store.close()


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    built = Index(tmp_path)
    yield built
    built.close()


def test_reindex_switches_to_the_new_model_and_rollback_returns(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    first = index.store.alias_target()
    old_points = index.store.count()
    with pytest.raises(FingerprintMismatch):
        index.ingest(new_model.url)

    report = reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert report.switched and report.previous == first
    assert report.collection.startswith("kb__") and report.collection != first
    assert index.store.alias_target() == report.collection
    assert index.store.count() == old_points == report.points
    assert report.verified_sample > 0
    assert report.min_sample_cosine is not None and report.min_sample_cosine >= 0.999
    fingerprint = index.store.fingerprint()
    assert fingerprint is not None and fingerprint.model.dimensions == 32

    searcher = Searcher(index.store, index.embedder(new_model.url), None)
    hit = searcher.search("Facts about subject number 3.", top_k=1, rerank=False).results[0]
    assert hit.uri == "corpus/topic3.md"
    index.ingest(new_model.url)  # the new model is accepted now

    assert rollback(index.store) == (report.collection, first)
    assert index.store.alias_target() == first
    with pytest.raises(FingerprintMismatch):
        index.ingest(new_model.url)


def test_a_reindex_of_stored_chunks_scans_the_collection_for_no_stale_chunks(
    index: Index, new_model: LocalTEIServer, old_model: LocalTEIServer
) -> None:
    # Scale trial: the build deleted each document's stale chunks with a filtered
    # delete, which local mode answers by scanning the growing collection: quadratic
    # (3,000 documents: 112 s, against 11 s without). The collection is new.
    index.ingest(old_model.url)
    index.store.close()
    client = recording_deletes(index.settings.qdrant_path)
    index.store = VectorStore(client, "kb")
    report = reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert report.switched and report.points == index.store.count() > 0
    assert "FilterSelector" not in client.deletes


def test_reindex_from_source_rechunks(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    said: list[str] = []
    report = reindex(
        index.store,
        lambda store: index.sync(new_model.url, store),
        from_source=[open_source(index.corpus)],
        progress=said.append,
    )
    assert report.documents == len(CORPUS)
    assert report.switched
    # How far it got, with the total: at once, then at most every PROGRESS_SECONDS.
    n = len(CORPUS)
    assert f"0 of {n} files done; embedded 0 documents (0 chunks)" in said
    assert f"embedded {n} documents ({report.points} chunks); verifying" in said
    said.clear()
    reindex(index.store, lambda store: index.sync(old_model.url, store), progress=said.append)
    assert any(line.startswith(f"re-embedded {n} of {n} documents") for line in said), said


def test_prune_keeps_the_live_collection_and_the_newest(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    reindex(index.store, lambda store: index.sync(new_model.url, store))
    reindex(index.store, lambda store: index.sync(new_model.url, store), force=True)
    assert len(index.store.collections()) == 3
    live = index.store.alias_target()
    dropped = prune(index.store, keep=1)
    assert len(dropped) == 2
    assert [info.name for info in index.store.collections()] == [live]


def test_a_reindex_that_would_only_copy_the_live_collection_is_refused(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    # Operator trial: a second reindex to the same model made an identical copy, and
    # `prune --keep 2` then deleted the old model's collection, the real way back.
    index.ingest(old_model.url)
    first = reindex(index.store, lambda store: index.sync(new_model.url, store))
    new_model.stats.reset()
    with pytest.raises(Refused, match=r"would only copy it. Pass --force"):
        reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert new_model.stats.inputs_embedded == 1  # the live model's canary, nothing built
    assert {info.name for info in index.store.collections()} == {first.collection, first.previous}

    # Other chunk settings are a real rebuild (as is --from-source, or --force).
    def headed(store: VectorStore) -> IndexSync:
        return IndexSync(store, index.embedder(new_model.url), Chunker(64, 8), embed_headings=True)

    rebuilt = reindex(index.store, headed)
    assert rebuilt.switched and rebuilt.previous == first.collection


def test_a_new_query_task_is_recorded_by_a_reindex_and_named_by_queries(
    index: Index, old_model: LocalTEIServer
) -> None:
    # Operator trial: with QUARRY_QUERY_TASK changed, queries kept the recorded task
    # without a word, and `quarry reindex` refused as "would only copy it".
    def tasked(task: str, profile: ProfileName = "qwen3") -> Callable[[VectorStore], IndexSync]:
        def make(store: VectorStore) -> IndexSync:
            client = EmbeddingClient(
                old_model.url, retry=NO_WAIT, prompt_profile=profile, query_task=task
            )
            index.clients.append(client)
            return IndexSync(store, client, Chunker(64, 8))

        return make

    run_sync(tasked("find old answers")(index.store), [open_source(index.corpus)])
    with pytest.raises(Refused, match="same query task and chunk settings"):
        reindex(index.store, tasked("find old answers"))
    searcher = Searcher(index.store, tasked("find new answers")(index.store).embedder, None)
    warned = searcher.search("granite", rerank=False).warnings
    assert warned == [
        "queries of 'kb' use the task its index records ('find old answers'), not "
        "QUARRY_QUERY_TASK ('find new answers'); `quarry reindex` records the new one"
    ]

    report = reindex(index.store, tasked("find new answers"))
    assert report.switched
    recorded = index.store.fingerprint()
    assert recorded is not None and recorded.query_task == "find new answers"
    searcher = Searcher(index.store, tasked("find new answers")(index.store).embedder, None)
    assert searcher.search("granite", rerank=False).warnings == []


def test_a_query_task_change_means_nothing_to_a_model_whose_queries_take_none(
    index: Index, old_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)  # profile "none": queries are embedded raw
    other = EmbeddingClient(old_model.url, retry=NO_WAIT, query_task="another task")
    index.clients.append(other)
    with pytest.raises(Refused, match="would only copy"):
        reindex(index.store, lambda store: IndexSync(store, other, Chunker(64, 8)))
    assert Searcher(index.store, other, None).search("granite", rerank=False).warnings == []


def test_a_service_that_embeds_otherwise_under_the_same_name_is_rebuilt_not_refused(
    index: Index, old_model: LocalTEIServer
) -> None:
    # Operator trial: the canary refusal says "run quarry reindex", which then refused
    # as "would only copy" because /info, the serving and the chunk settings were equal.
    index.ingest(old_model.url)
    first = index.store.alias_target()
    with pytest.raises(Refused, match="would only copy"):
        reindex(index.store, lambda store: index.sync(old_model.url, store))
    stored = index.store.metadata()[META_FINGERPRINT]
    moved = {**stored, "canary": [-x for x in stored["canary"]]}  # as if built by another
    index.store.update_metadata({META_FINGERPRINT: moved})
    report = reindex(index.store, lambda store: index.sync(old_model.url, store))
    assert report.switched and report.previous == first
    rebuilt = index.store.fingerprint()
    assert rebuilt is not None and rebuilt.canary == pytest.approx(stored["canary"])


def test_a_reindex_that_splits_chunks_checks_their_parts_too(
    index: Index, old_model: LocalTEIServer
) -> None:
    # Operator trial: after a move to a model with a shorter input limit nearly every
    # point is a part of a split chunk, and the check left them all out (reporting
    # cosine 1.0 for a sample of none).
    config = LocalTEIConfig(backend="hash", dims=16, seed=3, max_input_length=32)
    with LocalTEIServer(config) as short:
        index.ingest(old_model.url)
        report = reindex(index.store, lambda store: index.sync(short.url, store))
        records = list(index.store.scroll(fields=["token_count"], with_vectors=True))
        parts = [r for r in records if (r.payload or {}).get("token_count") is None]
        whole = len(records) - len(parts)
        assert len(parts) > 2 * whole
        assert min(VERIFY_SAMPLE, whole) < report.verified_sample <= report.points
        assert report.min_sample_cosine is not None and report.min_sample_cosine >= 0.999
        # Parts whose vectors are not what their text embeds are caught.
        index.store.client.update_vectors(
            collection_name=index.store.resolve(),
            points=[
                models.PointVectors(id=r.id, vector=[-x for x in r.vector])  # type: ignore[union-attr]
                for r in parts
            ],
        )
        with pytest.raises(StoreError, match="re-embeds with cosine"):
            verify(index.store, index.sync(short.url), index.store.count())


def test_split_chunks_repeated_across_documents_are_checked_too(index: Index) -> None:
    # Review: a chunk two documents share (a licence) has one split key for both
    # copies' parts, which the check took for one broken chunk and skipped.
    for path in index.corpus.iterdir():
        path.unlink()
    shared = "# Licence\n\n" + "Permission is granted to use this work freely. " * 12
    for name in ("one.md", "two.md"):
        (index.corpus / name).write_text(shared)
    config = LocalTEIConfig(backend="hash", dims=16, seed=3, max_input_length=32)
    with LocalTEIServer(config) as short:
        index.ingest(short.url)
        payloads = [r.payload or {} for r in index.store.scroll(fields=["token_count"])]
        assert payloads and all(p.get("token_count") is None for p in payloads)
        checked, lowest = verify(index.store, index.sync(short.url), index.store.count())
    assert checked > 0 and lowest is not None and lowest >= 0.999


def test_a_physical_collection_given_for_the_alias_is_named_as_such(
    index: Index, old_model: LocalTEIServer
) -> None:
    # Operator trial: `-c <a collection quarry collections lists>` said "does not
    # exist" (query, reindex, rollback) or "invalid setting: already exists".
    index.ingest(old_model.url)
    physical = index.store.alias_target()
    assert physical is not None
    view = VectorStore(index.store.client, physical)
    hint = rf"{physical}' is a collection, not an alias.*--collection kb"
    calls: list[Callable[[], object]] = [
        view.count,
        lambda: Searcher(view, index.embedder(old_model.url), None).search("x", rerank=False),
        lambda: reindex(view, lambda store: index.sync(old_model.url, store)),
        lambda: reindex(
            view,
            lambda store: index.sync(old_model.url, store),
            from_source=[open_source(index.corpus)],
        ),
        lambda: rollback(view),
        lambda: prune(view, 1),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=hint):
            call()
    assert {info.name for info in index.store.collections()} == {physical}


def test_rollback_to_a_named_collection_undoes_a_rollback(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    # Operator trial: after a rollback the complete new collection was still there, but
    # the only way back to it was a third build.
    index.ingest(old_model.url)
    first = index.store.alias_target()
    built = reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert rollback(index.store) == (built.collection, first)
    with pytest.raises(StoreError, match=r"nothing to roll back to .*rollback --to NAME"):
        rollback(index.store)
    assert rollback(index.store, to=built.collection) == (first, built.collection)
    assert index.store.alias_target() == built.collection
    index.ingest(new_model.url)  # served again, by the model that built it
    assert rollback(index.store) == (built.collection, first)  # and back, as before

    def refuse() -> dict[str, Any]:
        raise Refused("not good enough")

    with pytest.raises(Refused):
        reindex(index.store, lambda store: index.sync(new_model.url, store), gate=refuse)
    kept = next(i.name for i in index.store.collections() if i.metadata.get(META_BUILD) == REFUSED)
    with pytest.raises(StoreError, match="never switched to"):
        rollback(index.store, to=kept)
    with pytest.raises(StoreError, match="not one of its collections"):
        rollback(index.store, to="kb__000000000000__20200101000000")
    assert index.store.alias_target() == first


def test_a_build_says_how_far_it_got_and_prune_drops_unfinished_ones_first(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    first = index.store.alias_target()
    during: list[Any] = []

    def watch(message: str) -> None:
        if not during:  # while the new collection is built: a killed reindex leaves this
            during.extend(
                info.metadata.get(META_BUILD)
                for info in index.store.collections()
                if info.name != first
            )

    built = reindex(index.store, lambda store: index.sync(new_model.url, store), progress=watch)
    assert during == [BUILDING]
    assert index.store.metadata()[META_BUILD] == COMPLETE
    back = reindex(index.store, lambda store: index.sync(old_model.url, store))

    def refusing_gate() -> dict[str, Any]:
        raise Refused("nDCG@10 0.1 is below --min-ndcg 0.5")

    with pytest.raises(Refused):
        reindex(index.store, lambda store: index.sync(new_model.url, store), gate=refusing_gate)
    states = {info.name: info.metadata.get(META_BUILD) for info in index.store.collections()}
    refused = [name for name, state in states.items() if state == REFUSED]
    assert len(states) == 4 and len(refused) == 1
    # Kept: the served one, its rollback target, then the newest that served (the
    # first), not the refused build, though it is newer.
    assert prune(index.store, keep=3) == refused
    assert {info.name for info in index.store.collections()} == {
        back.collection,
        built.collection,
        first,
    }


def test_a_reindex_after_a_killed_one_names_the_build_it_left(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    # Model-migration trial: the rerun after a `kill -9` said nothing of the half build.
    index.ingest(old_model.url)
    fingerprint = index.store.fingerprint()
    assert fingerprint is not None
    killed = index.store.create_physical(fingerprint, {}, extra_metadata={META_BUILD: BUILDING})
    report = reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert report.switched
    [note] = [n for n in report.notes if "unfinished build" in n]
    assert killed in note and "quarry prune" in note
    again = reindex(index.store, lambda store: index.sync(old_model.url, store))
    assert any(killed in n for n in again.notes)  # until it is pruned
    prune(index.store, keep=2)
    third = reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert not any("unfinished build" in n for n in third.notes)


def test_engine_change_needs_accepted_parity(
    index: Index, old_model: LocalTEIServer, upgraded_engine: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    with pytest.raises(ServingChanged):
        index.ingest(upgraded_engine.url)
    report = measure_parity(
        index.store, index.embedder(old_model.url), index.embedder(upgraded_engine.url), sample=40
    )
    assert report.passed
    assert report.cosine_median == pytest.approx(1.0, abs=1e-6)
    assert report.overlap_at_10 == pytest.approx(1.0)
    accept(index.store, report)
    index.ingest(upgraded_engine.url)  # allowed now


def test_parity_compares_what_was_embedded_with_the_headings(
    index: Index, old_model: LocalTEIServer, upgraded_engine: LocalTEIServer
) -> None:
    # Vectors made from "breadcrumb + text": re-embedding the text alone would move
    # every one and fail parity for an engine that changed nothing.
    sync = IndexSync(
        index.store, index.embedder(old_model.url), Chunker(64, 8), embed_headings=True
    )
    run_sync(sync, [open_source(index.corpus)])
    report = measure_parity(
        index.store, index.embedder(old_model.url), index.embedder(upgraded_engine.url), sample=40
    )
    assert report.sample > 0
    assert report.cosine_min == pytest.approx(1.0, abs=1e-6)
    assert report.passed


def test_parity_refuses_another_model_and_accept_refuses_a_failure(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    with pytest.raises(FingerprintMismatch):
        measure_parity(index.store, index.embedder(old_model.url), index.embedder(new_model.url))
    # The live service serving another model is refused too, naming it: not a "parity
    # not reached" (exit 1) on an overlap@10 measured against the wrong model.
    with pytest.raises(FingerprintMismatch, match="live embedding service"):
        measure_parity(index.store, index.embedder(new_model.url), index.embedder(old_model.url))
    report = measure_parity(
        index.store, index.embedder(old_model.url), index.embedder(old_model.url), sample=10
    )
    report.passed = False
    with pytest.raises(Refused):
        accept(index.store, report)


def test_reindex_from_only_some_sources_is_not_switched_to(
    index: Index, tmp_path: Path, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    other = write_corpus(tmp_path / "other", {"x.md": "Another source entirely. " * 20})
    index.ingest(old_model.url)
    run_sync(index.sync(old_model.url), [open_source(other)])
    served = index.store.alias_target()
    new_model.stats.reset()
    with pytest.raises(MassDeleteRefused, match=r"leave out 8 of the 9 documents") as caught:
        reindex(
            index.store,
            lambda store: index.sync(new_model.url, store),
            from_source=[open_source(other)],
        )
    # Names the source left out, and the rule (not a fraction the setting does not hold).
    assert "sources left out of --from-source: corpus (8 of 8)" in str(caught.value)
    # However small: a source of 1 in 9 documents, left out, is refused as well.
    with pytest.raises(MassDeleteRefused, match=r"other \(1 of 1\)"):
        reindex(
            index.store,
            lambda store: index.sync(new_model.url, store),
            from_source=[open_source(index.corpus)],
        )
    assert index.store.alias_target() == served
    assert [info.name for info in index.store.collections()] == [served]
    assert new_model.stats.inputs_embedded == 0  # refused before anything was built
    # A source given with globs that leave most of it out is refused after the build.
    with pytest.raises(MassDeleteRefused, match=r"new collection .* \(dropped\)"):
        reindex(
            index.store,
            lambda store: index.sync(new_model.url, store),
            from_source=[open_source(index.corpus, include=("topic1.*",)), open_source(other)],
        )
    assert [info.name for info in index.store.collections()] == [served]
    report = reindex(
        index.store,
        lambda store: index.sync(new_model.url, store),
        from_source=[open_source(other)],
        allow_mass_delete=True,
    )
    assert report.switched and report.documents == 1


def test_a_canary_that_drifts_during_the_reindex_drops_the_build_and_blames_the_service(
    index: Index, new_model: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import quarry.ingest
    from quarry.errors import StoreError

    index.ingest(new_model.url)
    served = index.store.alias_target()
    real = quarry.ingest.read_fingerprint

    def drifting(embedder: Any) -> Any:  # a service that is not deterministic
        live = real(embedder)
        return dataclasses.replace(live, canary=[-x for x in live.canary])

    monkeypatch.setattr(quarry.ingest, "read_fingerprint", drifting)
    with pytest.raises(StoreError, match="not deterministic or changed during the reindex") as e:
        reindex(index.store, lambda store: index.sync(new_model.url, store), force=True)
    assert "quarry reindex" not in str(e.value)  # not the advice to run what is running
    assert index.store.alias_target() == served
    assert [info.name for info in index.store.collections()] == [served]


def test_a_half_written_document_is_carried_for_the_next_ingest_to_mend(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    from qdrant_client import models

    index.ingest(old_model.url)
    # An ingest killed while rewriting topic5.md: its first chunk is of a newer version.
    victim = index.store.index_state()
    doc_id = next(d for d, state in victim.items() if state.uri.endswith("topic5.md"))
    first = models.Filter(
        must=[
            models.FieldCondition(key="doc_id", match=models.MatchValue(value=doc_id)),
            models.FieldCondition(key="chunk_index", match=models.MatchValue(value=0)),
        ]
    )
    index.store.client.set_payload(
        index.store.resolve() or "", {"doc_hash": "newer", "chunk_count": 1}, first
    )
    # ... and one killed while re-chunking topic6.md: same text and count, two settings.
    other = next(d for d, state in victim.items() if state.uri.endswith("topic6.md"))
    index.store.client.set_payload(
        index.store.resolve() or "",
        {"chunking": "0123456789ab"},
        models.Filter(
            must=[
                models.FieldCondition(key="doc_id", match=models.MatchValue(value=other)),
                models.FieldCondition(key="chunk_index", match=models.MatchValue(value=0)),
            ]
        ),
    )
    report = reindex(index.store, lambda store: index.sync(new_model.url, store))
    assert report.switched
    assert any("2 document(s) left half-written" in note for note in report.notes)
    state = index.store.index_state()[doc_id]
    assert state.hashes == {INTERRUPTED_WRITE}
    assert index.store.index_state()[other].hashes == {INTERRUPTED_WRITE}
    # Renumbered whole by the reindex, still not complete: `quarry status` counts them.
    assert sum(not s.is_complete() for s in index.store.index_state().values()) == 2
    # The next ingest reads the files again (their stamps no longer vouch) and mends them.
    again = run_sync(index.sync(new_model.url), [open_source(index.corpus)])
    assert again.documents_embedded == 2
    assert index.store.index_state()[doc_id].hashes != {INTERRUPTED_WRITE}


def test_reindex_of_stored_chunks_keeps_the_chunking_that_made_them(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)  # 64-token chunks
    recorded = index.store.metadata()[META_CHUNKING]

    def smaller(store: VectorStore) -> IndexSync:
        return IndexSync(store, index.embedder(new_model.url), Chunker(32, 4))

    reindex(index.store, smaller)
    assert index.store.metadata()[META_CHUNKING] == recorded
    report = run_sync(smaller(index.store), [open_source(index.corpus)])
    assert report.documents_embedded == len(CORPUS)  # re-chunked at 32 now


def test_reindex_of_stored_chunks_embeds_headings_as_set_and_records_it(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)  # headings off
    recorded = index.store.metadata()[META_CHUNKING]

    def headed(store: VectorStore, embed_headings: bool = True) -> IndexSync:
        return IndexSync(
            store, index.embedder(new_model.url), Chunker(64, 8), embed_headings=embed_headings
        )

    report = reindex(index.store, headed)  # its verify re-embeds a sample with headings
    assert report.switched and report.documents == len(CORPUS)
    assert index.store.metadata()[META_CHUNKING] == {**recorded, "embed_headings": True}
    # The reindex embedded the headings and its points say so: a sync with them has
    # nothing to do, one without them re-embeds every document.
    same = run_sync(headed(index.store), [open_source(index.corpus)])
    assert (same.documents_embedded, same.notes) == (0, [])
    off = run_sync(headed(index.store, False), [open_source(index.corpus)])
    assert off.documents_embedded == len(CORPUS)


def test_prune_keeps_the_rollback_target_and_other_aliases_collections(
    index: Index, tmp_path: Path, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    original = index.store.alias_target()
    # A never-served build newer than the original (a reindex killed half way).
    fingerprint = index.store.fingerprint()
    assert fingerprint is not None
    index.store.create_physical(fingerprint, {})
    # Another alias whose name starts with this one's.
    archive = VectorStore(index.store.client, "kb__archive")
    run_sync(
        IndexSync(archive, index.embedder(old_model.url), Chunker(64, 8)),
        [open_source(index.corpus)],
    )
    assert all(not info.name.startswith("kb__archive") for info in index.store.collections())
    report = reindex(index.store, lambda store: index.sync(new_model.url, store))
    dropped = prune(index.store, keep=2)
    assert len(dropped) == 1 and dropped[0] not in (original, report.collection)
    assert archive.count() > 0  # the other alias's collection is untouched
    assert rollback(index.store) == (report.collection, original)
    with pytest.raises(StoreError, match="not built by a reindex"):
        rollback(index.store)


def test_collections_names_no_rollback_target_that_prune_deleted(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    # Model-migration trial: after a prune and a rollback, `collections --json` gave the
    # live collection a "previous" (its rollback target, as documented) that was gone.
    from typer.testing import CliRunner

    from quarry.cli import app

    index.ingest(old_model.url)
    first = index.store.alias_target()
    middle = reindex(index.store, lambda store: index.sync(new_model.url, store)).collection
    last = reindex(index.store, lambda store: index.sync(old_model.url, store)).collection
    assert prune(index.store, keep=2) == [first]
    assert rollback(index.store) == (last, middle)  # middle was built over first
    index.store.close()
    env = {"QUARRY_DATA_DIR": str(index.settings.data_dir), "QUARRY_COLLECTION": "kb"}
    listed = CliRunner().invoke(app, ["collections", "--json"], env=env)
    assert listed.exit_code == 0, listed.output
    previous = {row["name"]: row["previous"] for row in json.loads(listed.stdout)["collections"]}
    assert previous == {last: middle, middle: None}
    index.store = VectorStore(open_client(index.settings), "kb")


def test_reindex_from_source_leaves_out_a_file_ingest_never_indexed(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    # Ingest reports an unreadable file and skips it; a reindex of the same folder
    # loses nothing the alias serves by skipping it too.
    (index.corpus / "bin.md").write_bytes(b"\x00\x01binary" * 40)
    index.ingest(old_model.url)
    served = index.store.alias_target()
    uris = {state.uri for state in index.store.index_state().values()}
    report = reindex(
        index.store,
        lambda store: index.sync(new_model.url, store),
        from_source=[open_source(index.corpus)],
    )
    assert report.switched and index.store.alias_target() == report.collection != served
    assert report.failures == [
        {"uri": "corpus/bin.md", "error": "binary file (NUL bytes), skipped"}
    ]  # reported once
    assert any("never indexed" in note for note in report.notes)
    assert {state.uri for state in index.store.index_state().values()} == uris
    assert report.documents == len(CORPUS) and "corpus/bin.md" not in uris


def test_reindex_refuses_to_lose_a_served_file_that_became_unreadable(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    served = index.store.alias_target()
    (index.corpus / "topic3.md").write_bytes(b"\x00\x01binary" * 40)
    (index.corpus / "new.md").write_bytes(b"\x00never indexed")  # not what refuses
    with pytest.raises(Refused, match=r"1 document\(s\) failed") as caught:
        reindex(
            index.store,
            lambda store: index.sync(new_model.url, store),
            from_source=[open_source(index.corpus)],
        )
    message = str(caught.value)
    assert "corpus/topic3.md: binary file" in message and "new.md" not in message
    assert "was dropped" in message and f"still points at {served}" in message
    assert not getattr(caught.value, "__notes__", [])  # said once, not again in a note
    assert index.store.alias_target() == served
    assert [info.name for info in index.store.collections()] == [served]


def test_a_reindex_whose_embedding_service_fails_leaves_no_collection(
    index: Index, old_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    served = index.store.alias_target()
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, seed=9)) as going:

        def goes_away(message: str) -> None:
            if message.startswith("building"):
                going.stop()  # after the new collection was created

        with pytest.raises(ServiceError) as failed:
            reindex(index.store, lambda store: index.sync(going.url, store), progress=goes_away)
    assert index.store.alias_target() == served
    assert [info.name for info in index.store.collections()] == [served]
    # The error says so (operator trial: it named the service and the document only).
    assert failed.value.__notes__ == [
        f"the alias 'kb' was not switched; it still serves {served}, and the unfinished "
        "collection was dropped: run the reindex again"
    ]


def test_reindex_refuses_when_a_folder_with_served_documents_cannot_be_listed(
    index: Index,
    old_model: LocalTEIServer,
    new_model: LocalTEIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (index.corpus / "private").mkdir()
    (index.corpus / "private" / "secret.md").write_text("# Secret\n\nServed today.")
    index.ingest(old_model.url)
    served = index.store.alias_target()
    fail_listing(monkeypatch, "private")
    # Ingest keeps what lies under a folder it cannot list; a reindex that built
    # without it must not switch to a collection that lost corpus/private/secret.md.
    with pytest.raises(Refused, match="corpus/private/: cannot list directory"):
        reindex(
            index.store,
            lambda store: index.sync(new_model.url, store),
            from_source=[open_source(index.corpus)],
        )
    assert index.store.alias_target() == served
    assert [info.name for info in index.store.collections()] == [served]


def test_an_evaluation_gate_that_breaks_off_drops_the_build_and_one_that_refuses_keeps_it(
    index: Index, old_model: LocalTEIServer, new_model: LocalTEIServer
) -> None:
    index.ingest(old_model.url)
    served = index.store.alias_target()

    def broken_gate() -> dict[str, Any]:
        raise ServiceError("http://eval", "went away")

    with pytest.raises(ServiceError):
        reindex(index.store, lambda store: index.sync(new_model.url, store), gate=broken_gate)
    assert [info.name for info in index.store.collections()] == [served]

    def refusing_gate() -> dict[str, Any]:
        raise Refused("nDCG@10 0.1 is below --min-ndcg 0.5")

    with pytest.raises(Refused):
        reindex(index.store, lambda store: index.sync(new_model.url, store), gate=refusing_gate)
    assert index.store.alias_target() == served
    assert len(index.store.collections()) == 2  # kept for inspection, as documented
