"""The Qdrant store in local mode: storage tuning and collection naming."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import models

from quarry._async_clients import AsyncStore, ThreadedLocalQdrant, open_async_qdrant
from quarry.config import Settings
from quarry.errors import ConfigError, WriteFailed
from quarry.fingerprint import Fingerprint, ModelIdentity, ServingIdentity
from quarry.store import SEARCH_FIELDS, DocState, VectorStore, open_client


def _fingerprint() -> Fingerprint:
    return Fingerprint(
        model=ModelIdentity("m", None, "mean", 4, True, "none"),
        serving=ServingIdentity("tei", "1.9.3", "float32", 32),
        canary=[0.5, 0.5, 0.5, 0.5],
        query_task="t",
    )


def test_local_collections_use_a_write_ahead_log(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, collection="wal")
    store = VectorStore(open_client(settings), "wal")
    physical = store.create(_fingerprint(), {"max_tokens": 8})
    store.close()
    files = list(settings.qdrant_path.rglob("storage.sqlite"))
    assert len(files) == 1 and physical in str(files[0])
    with sqlite3.connect(files[0]) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_two_rebuilds_in_one_second_get_distinct_names(tmp_path: Path) -> None:
    store = VectorStore(open_client(Settings(data_dir=tmp_path, collection="kb")), "kb")
    try:
        names = {store.create_physical(_fingerprint(), {}) for _ in range(3)}
        assert len(names) == 3
        assert all(name.startswith("kb__") for name in names)
    finally:
        store.close()


def test_a_physical_collection_given_as_the_alias_is_refused_creating_nothing(
    tmp_path: Path,
) -> None:
    client = open_client(Settings(data_dir=tmp_path, collection="kb"))
    try:
        physical = VectorStore(client, "kb").create(_fingerprint(), {})
        before = {c.name for c in client.get_collections().collections}
        with pytest.raises(ConfigError, match=r"is a collection, not an alias.*--collection kb"):
            VectorStore(client, physical).create(_fingerprint(), {})
        assert {c.name for c in client.get_collections().collections} == before
    finally:
        client.close()


def test_collections_rank_unit_vectors_by_dot_product_and_queries_at_any_scale(
    tmp_path: Path,
) -> None:
    # Dot product, not cosine: local mode re-normalises every stored vector on each
    # cosine query. The query is scaled to unit length, so scores stay cosines.
    store = VectorStore(open_client(Settings(data_dir=tmp_path, collection="kb")), "kb")
    try:
        physical = store.create(_fingerprint(), {})
        vectors = store.client.get_collection(physical).config.params.vectors
        assert isinstance(vectors, models.VectorParams)
        assert vectors.distance == models.Distance.DOT
        near, far = _point("near", 0, 1, "s"), _point("far", 0, 1, "s")
        near.vector, far.vector = [0.6, 0.8, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]
        store.upsert([near, far])
        hits = store.search([3.0, 4.0, 0.0, 0.0], 2)
        assert [hit.payload["doc_id"] for hit in hits] == ["near", "far"]  # type: ignore[index]
        assert [hit.score for hit in hits] == pytest.approx([1.0, 0.0], abs=1e-6)
    finally:
        store.close()


def test_searches_return_the_result_fields_and_leave_the_bookkeeping_in_qdrant(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path, collection="kb")
    store = VectorStore(open_client(settings), "kb")
    point = _point("a", 0, 1, "docs")
    assert point.payload is not None
    point.payload.update(title="A", headings=["Intro"], model_key="k", chunking="c")
    try:
        store.create(_fingerprint(), {})
        store.upsert([point])
        (hit,) = store.search([0.5, 0.5, 0.5, 0.5], 5)
    finally:
        store.close()

    async def search_async() -> list[models.ScoredPoint]:
        async_store = AsyncStore(open_async_qdrant(settings), "kb")
        try:
            return await async_store.search([0.5, 0.5, 0.5, 0.5], 5)
        finally:
            await async_store.close()

    (async_hit,) = asyncio.run(search_async())
    shown = {"text", "uri", "doc_id", "chunk_index", "title", "headings", "metadata", "model_key"}
    assert set(SEARCH_FIELDS) == shown
    for found in (hit, async_hit):
        assert found.payload == {key: point.payload[key] for key in shown}


def _point(doc: str, index: int, count: int, source: str) -> models.PointStruct:
    return models.PointStruct(
        id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{doc}/{index}")),
        vector=[0.5, 0.5, 0.5, 0.5],
        payload={
            "doc_id": doc,
            "uri": f"{source}/{doc}.md",
            "source": source,
            "doc_hash": f"hash-{doc}",
            "chunk_count": count,
            "chunk_index": index,
            "text": "x",
            "metadata": {"mtime": "2026-01-01T00:00:00+00:00", "size": 3, "loader": 1},
        },
    )


def test_index_state_reads_local_payloads_in_place_and_agrees_with_a_scroll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = VectorStore(open_client(Settings(data_dir=tmp_path, collection="kb")), "kb")
    try:
        physical = store.create(_fingerprint(), {})
        store.upsert([_point("a", i, 3, "docs") for i in range(3)])
        store.upsert([_point("b", i, 2, "notes") for i in range(2)])
        store.upsert([_point("c", 0, 1, "docs")])
        store.delete_stale_chunks("a", 2)  # a's chunk 2 is deleted: a flag, not a removal
        store.delete_documents(["c"])
        assert store._local_payloads(physical) is not None  # the fast path, not the fallback
        in_place = {source: store.index_state(source) for source in (None, "docs", "notes")}
        monkeypatch.setattr(VectorStore, "_local_payloads", lambda self, physical: None)
        scrolled = {source: store.index_state(source) for source in (None, "docs", "notes")}
    finally:
        store.close()
    assert in_place == scrolled
    assert sorted(in_place[None]) == ["a", "b"]
    assert in_place[None]["a"].indexes == {0, 1} and in_place[None]["a"].points == 2
    assert sorted(in_place["docs"]) == ["a"]


def test_source_records_are_merged_by_name_and_kept_in_the_collection(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, collection="kb")
    store = VectorStore(open_client(settings), "kb")
    try:
        store.record_sources({"docs": {"root": "/a/docs"}})  # no collection: nothing, no error
        assert store.source_records() == {}
        store.create(_fingerprint(), {})
        store.record_sources({"docs": {"root": "/a/docs"}, "notes": {"root": "/a/notes"}})
        store.record_sources({"docs": {"root": "/b/docs"}})
    finally:
        store.close()
    store = VectorStore(open_client(settings), "kb")  # as the next run reads it
    try:
        assert store.source_records() == {
            "docs": {"root": "/b/docs"},
            "notes": {"root": "/a/notes"},
        }
        stored = store.fingerprint()  # the rest of the metadata is kept
        assert stored is not None and stored.model_key == _fingerprint().model_key
    finally:
        store.close()


def test_source_records_as_recorded_are_not_written_again(tmp_path: Path) -> None:
    from qdrant_client import QdrantClient

    class Counting(QdrantClient):
        updates = 0

        def update_collection(self, *args: object, **kwargs: object) -> bool:
            Counting.updates += 1
            return super().update_collection(*args, **kwargs)  # type: ignore[arg-type]

    store = VectorStore(Counting(path=str(tmp_path / "q")), "kb")
    try:
        store.create(_fingerprint(), {})
        before = Counting.updates
        store.record_sources({"docs": {"root": "/a/docs"}})
        store.record_sources({"docs": {"root": "/a/docs"}})  # a nightly re-ingest: as it was
        assert Counting.updates == before + 1
        store.record_sources({"docs": {"root": "/b/docs"}})
        assert Counting.updates == before + 2
    finally:
        store.close()


def _local_connection(store: VectorStore, physical: str) -> sqlite3.Connection:
    connection = store.client._client.collections[physical].storage.storage  # type: ignore[attr-defined]
    assert isinstance(connection, sqlite3.Connection)
    return connection


def test_a_local_upsert_is_one_transaction_on_disk(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, collection="tx")
    store = VectorStore(open_client(settings), "tx")
    physical = store.create(_fingerprint(), {})
    statements: list[str] = []
    _local_connection(store, physical).set_trace_callback(statements.append)
    store.upsert([_point("a", i, 20, "docs") for i in range(20)])
    assert sum(s.upper().startswith("COMMIT") for s in statements) == 1
    assert sum("INSERT OR REPLACE" in s for s in statements) == 20
    store.close()
    reopened = VectorStore(open_client(settings), "tx")
    try:
        assert reopened.count() == 20
    finally:
        reopened.close()


def test_a_local_upsert_that_fails_midway_leaves_on_disk_what_memory_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path, collection="tx")
    store = VectorStore(open_client(settings), "tx")
    physical = store.create(_fingerprint(), {})
    store.upsert([_point("kept", 0, 1, "docs")])
    persistence = store.client._client.collections[physical].storage  # type: ignore[attr-defined]
    persist = persistence.persist
    written: list[object] = []

    def failing_persist(point: models.PointStruct) -> None:
        if len(written) == 3:
            raise sqlite3.OperationalError("database or disk is full")
        persist(point)
        written.append(point.id)

    monkeypatch.setattr(persistence, "persist", failing_persist)
    with pytest.raises(WriteFailed, match="upsert of 10 points failed"):
        store.upsert([_point("torn", i, 10, "docs") for i in range(10)])
    assert len(written) == 3
    assert isinstance(persistence.storage, sqlite3.Connection)  # the real connection is back
    in_memory = store.count()
    assert in_memory == 4  # "kept" and the three points applied before the failure
    store.close()
    reopened = VectorStore(open_client(settings), "tx")
    try:
        assert reopened.count() == in_memory  # the disk agrees with what memory held
        assert reopened.index_state()["torn"].points == 3  # a torn write the sync redoes
    finally:
        reopened.close()


def test_a_data_dir_that_cannot_hold_qdrant_is_a_config_error_for_both_clients(
    tmp_path: Path,
) -> None:
    from quarry._async_clients import open_async_qdrant
    from quarry.errors import ConfigError

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    settings = Settings(data_dir=not_a_folder, collection="kb")
    for opener in (open_client, open_async_qdrant):
        with pytest.raises(ConfigError, match=f"QUARRY_DATA_DIR={not_a_folder}: cannot create"):
            opener(settings)


@pytest.mark.parametrize("damage", ["meta.json", "storage.sqlite"])
def test_a_damaged_local_folder_is_a_store_error_naming_it_for_both_clients(
    tmp_path: Path, damage: str
) -> None:
    from quarry._async_clients import open_async_qdrant
    from quarry.errors import StoreError

    settings = Settings(data_dir=tmp_path, collection="kb")
    store = VectorStore(open_client(settings), "kb")
    store.create(_fingerprint(), {"max_tokens": 8})
    store.upsert(
        [models.PointStruct(id=str(uuid.uuid4()), vector=[0.5] * 4, payload={"doc_id": "d"})]
    )
    store.close()
    if damage == "meta.json":
        (settings.qdrant_path / "meta.json").write_text('{"collections": {"kb__')
    else:
        for file in settings.qdrant_path.rglob("storage.sqlite*"):
            if file.name == "storage.sqlite":
                file.write_bytes(file.read_bytes()[:4096] + b"\x00garbage" * 512)
            else:
                file.unlink()  # the write-ahead log, which would mend it
    for opener in (open_client, open_async_qdrant):
        with pytest.raises(StoreError, match="cannot be read") as caught:
            opener(settings)
        message = str(caught.value)
        assert str(settings.qdrant_path) in message and "restore the folder" in message


@pytest.mark.parametrize(
    ("hashes", "counts", "indexes", "complete"),
    [
        ({"h"}, {3}, {0, 1, 2}, True),
        ({"h"}, {3}, {0, 1}, False),  # a write interrupted after two of three chunks
        ({"h", "g"}, {3}, {0, 1, 2}, False),  # two versions of the text mixed
        ({"h"}, {3, 2}, {0, 1, 2}, False),
    ],
)
def test_a_document_is_complete_only_as_one_whole_write(
    hashes: set[str], counts: set[int], indexes: set[int], complete: bool
) -> None:
    state = DocState("d", "kb/a.md", hashes, counts, indexes, points=len(indexes))
    assert state.is_complete() is complete
    assert state.is_current("h") is (complete and hashes == {"h"})


def _random_collection(
    path: Path, points: int, size: int, distance: models.Distance = models.Distance.DOT
) -> list[list[float]]:
    """A local-mode collection ``c`` (aliased ``kb``) of random vectors; returns random
    queries."""
    from qdrant_client import QdrantClient

    chosen = random.Random(7)
    client = QdrantClient(path=str(path))
    client.create_collection("c", models.VectorParams(size=size, distance=distance))
    client.upsert(
        "c",
        [
            models.PointStruct(
                id=i, vector=[chosen.uniform(-1, 1) for _ in range(size)], payload={"n": i}
            )
            for i in range(points)
        ],
    )
    client.update_collection_aliases(
        change_aliases_operations=[
            models.CreateAliasOperation(
                create_alias=models.CreateAlias(collection_name="c", alias_name="kb")
            )
        ]
    )
    client.close()
    return [[chosen.uniform(-1, 1) for _ in range(size)] for _ in range(24)]


def _search(client: ThreadedLocalQdrant, query: list[float]) -> Any:
    return client.query_points("kb", query=query, limit=10, query_filter=None, with_payload=True)


def _watch_threads(client: ThreadedLocalQdrant, before: Any = None) -> list[str]:
    """Record the thread each search runs on (after ``before``, if given)."""
    names: list[str] = []
    search = client._client.query_points

    def watched(*args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        if before is not None:
            before()
        return search(*args, **kwargs)

    client._client.query_points = watched  # type: ignore[method-assign]
    return names


def _unwatch(client: ThreadedLocalQdrant) -> None:
    # The wrapper refers to the client: left in place, the client's last reference
    # would go on this thread, where its __del__ touches SQLite.
    vars(client._client).pop("query_points", None)


def test_local_searches_run_at_once_and_answer_as_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qdrant_client.local.persistence import CollectionPersistence

    queries = _random_collection(tmp_path / "q", 300, 32)
    # As on a platform whose SQLite refuses a connection used by another thread: the
    # searches, on threads of their own, never touch it.
    monkeypatch.setattr(CollectionPersistence, "CHECK_SAME_THREAD", True)

    async def main() -> None:
        client = ThreadedLocalQdrant(str(tmp_path / "q"), search_threads=4)
        try:
            alone = [(await _search(client, query)).points for query in queries]
            # Two searches must be under way together to pass the barrier.
            threads = _watch_threads(client, threading.Barrier(2, timeout=10).wait)
            met = await asyncio.gather(*(_search(client, query) for query in queries[:2]))
            _unwatch(client)
            together = await asyncio.gather(*(_search(client, query) for query in queries * 4))
        finally:
            _unwatch(client)
            await client.close()
        assert [len(answer.points) for answer in met] == [10, 10]
        assert len(set(threads)) == 2 and all(
            name.startswith("quarry-qdrant-search") for name in threads
        )
        for answer, expected in zip(together, alone * 4, strict=True):
            assert [(p.id, p.payload) for p in answer.points] == [
                (p.id, p.payload) for p in expected
            ]
            assert [p.score for p in answer.points] == pytest.approx([p.score for p in expected])

    asyncio.run(main())


@pytest.mark.parametrize(
    ("distance", "query_filter"),
    [
        (models.Distance.COSINE, None),
        (
            models.Distance.DOT,
            models.Filter(must=[models.FieldCondition(key="n", range=models.Range(gte=0))]),
        ),
    ],
    ids=["cosine", "filtered"],
)
def test_searches_that_cannot_share_the_collection_run_one_at_a_time(
    tmp_path: Path, distance: models.Distance, query_filter: models.Filter | None
) -> None:
    # Local mode's cosine search divides the stored vectors by their norms in place:
    # two at once would divide them twice. A filter is tested against every payload
    # in Python, holding the GIL: two at once only keep the event loop waiting longer.
    queries = _random_collection(tmp_path / "q", 50, 8, distance)

    async def main() -> list[str]:
        client = ThreadedLocalQdrant(str(tmp_path / "q"), search_threads=4)
        try:
            threads = _watch_threads(client)
            answers = await asyncio.gather(
                *(
                    client.query_points(
                        "kb", query=query, limit=10, query_filter=query_filter, with_payload=True
                    )
                    for query in queries[:8]
                )
            )
            assert all(len(answer.points) == 10 for answer in answers)
            return threads
        finally:
            _unwatch(client)
            await client.close()

    threads = asyncio.run(main())
    assert len(threads) == 8 and set(threads) == {"quarry-qdrant_0"}


@pytest.mark.parametrize("cancelled", [False, True], ids=["awaited", "cancelled"])
def test_closing_local_qdrant_waits_for_the_searches_under_way(
    tmp_path: Path, cancelled: bool
) -> None:
    from qdrant_client import QdrantClient

    queries = _random_collection(tmp_path / "q", 50, 8)

    async def main() -> None:
        client = ThreadedLocalQdrant(str(tmp_path / "q"), search_threads=2)
        release = threading.Event()
        _watch_threads(client, lambda: release.wait(10))
        searching = asyncio.ensure_future(_search(client, queries[0]))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(client.close())
        await asyncio.sleep(0.2)
        assert not closing.done()  # the search under way still reads the collection
        _unwatch(client)  # (the search under way keeps its wrapper)
        if cancelled:
            closing.cancel()
        release.set()
        answer = await searching
        assert len(answer.points) == 10
        if not cancelled:
            await closing
            return
        # Cancelled, the closing still happens: the folder's lock is let go.
        for _ in range(100):
            try:
                QdrantClient(path=str(tmp_path / "q")).close()
                return
            except RuntimeError:  # still held
                await asyncio.sleep(0.1)
        raise AssertionError("the folder stayed locked after a cancelled close")

    asyncio.run(asyncio.wait_for(main(), 30))
