"""Qdrant: collections behind an alias, fingerprint metadata, checked writes, index scans.

The alias (``QUARRY_COLLECTION``) is what users name; it points at a physical
collection ``<alias>__<model_key>__<UTC yyyymmddHHMMSS>``, so a reindex builds a
new one beside it and switches the alias atomically.

Vectors are stored at unit length (the embedding clients scale them) and new
collections rank by dot product, which for unit vectors is the cosine. Qdrant's
server does the same for a cosine collection; its local mode instead re-normalises
every stored vector on every cosine query (45 ms a query at 20,000 points), and
with a dot product it does not. Collections made as cosine by earlier versions are
searched as they are.
"""

from __future__ import annotations

import errno
import math
import pickle
import re
import sqlite3
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError
from qdrant_client import QdrantClient, models

from quarry.config import Settings, make_data_folder
from quarry.documents import FileStamp
from quarry.errors import ConfigError, StoreError, StoreLocked, StoreUnavailable, WriteFailed
from quarry.fingerprint import Fingerprint


def unit_vector(vector: Sequence[float]) -> list[float]:
    """``vector`` at unit length (a zero vector as it is), for dot-product collections."""
    norm = math.hypot(*vector)
    if norm == 0 or abs(norm - 1) < 1e-5:  # the embedding clients' vectors already are
        return list(vector)
    return [x / norm for x in vector]


def _write_failed(collection: str, what: str, error: BaseException) -> WriteFailed:
    """The error for a write that raised ``error``: StoreUnavailable when it says Qdrant
    can take no write at all (see :func:`_store_wide`)."""
    failure = StoreUnavailable if _store_wide(error) else WriteFailed
    return failure(collection, f"{what} failed: {error}")


def _store_wide(error: BaseException) -> bool:
    """Whether a failed write says Qdrant itself cannot take writes (any points), not
    that these points were refused: no connection or answer, a 5xx, a disk full."""
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    if isinstance(error, sqlite3.Error | OSError | ResponseHandlingException | TimeoutError):
        return True  # local mode's database (disk full, I/O); the server's transport
    if isinstance(error, UnexpectedResponse):
        # 401/403: a wrong or read-only key; 404: the collection is gone under the run.
        status = error.status_code
        return status is None or status >= 500 or status in (401, 403, 404)
    code = getattr(error, "code", None)  # gRPC
    if callable(code):
        try:
            name = getattr(code(), "name", "")
        except Exception:  # pragma: no cover - not a gRPC error after all
            return False
        return name in {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL"}
    return False


META_FINGERPRINT = "quarry_fingerprint"
META_CHUNKING = "quarry_chunking"
META_ACCEPTED_SERVING = "quarry_accepted_serving"
META_PARITY = "quarry_parity"
# Where each folder source was last synced from whole, and with which globs, by source
# name: {"kb": {"root": "/srv/kb", "include": [...], "exclude": [...]}}.
META_SOURCES = "quarry_sources"

INDEXED_FIELDS: dict[str, models.PayloadSchemaType] = {
    "doc_id": models.PayloadSchemaType.KEYWORD,
    "doc_hash": models.PayloadSchemaType.KEYWORD,
    "uri": models.PayloadSchemaType.KEYWORD,
    "source": models.PayloadSchemaType.KEYWORD,
    "path_prefixes": models.PayloadSchemaType.KEYWORD,
    "model_key": models.PayloadSchemaType.KEYWORD,
    "chunk_index": models.PayloadSchemaType.INTEGER,
}
# "metadata" whole rather than its stamp fields: local mode parses each nested path for
# every point, and the whole (small) dict reads twice as fast.
_SCAN_FIELDS = [
    "doc_id",
    "uri",
    "source",
    "doc_hash",
    "chunk_count",
    "chunk_index",
    "chunking",
    "metadata",
]

SEARCH_FIELDS = [
    "text",
    "uri",
    "doc_id",
    "chunk_index",
    "title",
    "headings",
    "metadata",
    "model_key",
]
"""The payload a search returns: what a result shows, and the ``model_key`` that the
query API checks. The bookkeeping fields (hashes, spans, timestamps, chunking) stay in
Qdrant: a Qdrant server sends less, and local mode deep-copies less, per candidate."""


# The hash a reindex gives a document whose points disagree (an ingest was killed
# while it wrote them): no content hash equals it, so the next sync reads the file again.
INTERRUPTED_WRITE = "interrupted-write"


@dataclass(slots=True)
class DocState:
    """What the index holds for one document, read from its points."""

    doc_id: str
    uri: str
    hashes: set[str] = field(default_factory=set)
    chunk_counts: set[int] = field(default_factory=set)
    indexes: set[int] = field(default_factory=set)
    points: int = 0
    # The file stamps the points were written with (see quarry.sources.FileStamp).
    stamps: set[FileStamp | None] = field(default_factory=set)
    # The chunk settings keys the points were made with (None: not recorded).
    chunkings: set[str | None] = field(default_factory=set)

    def is_current(self, doc_hash: str) -> bool:
        """True when every point carries ``doc_hash`` and exactly chunks 0..n-1 exist."""
        return self.hashes == {doc_hash} and self.is_complete()

    def is_complete(self) -> bool:
        """True when the points are one whole write: one text, exactly chunks 0..n-1
        (not a write that was interrupted, nor a mix of two versions, nor such a write
        a reindex carried over)."""
        if len(self.hashes) != 1 or len(self.chunk_counts) != 1 or INTERRUPTED_WRITE in self.hashes:
            return False
        (count,) = self.chunk_counts
        return self.points == count and self.indexes == set(range(count))


@dataclass(frozen=True, slots=True)
class CollectionInfo:
    """A physical collection as ``quarry collections`` lists it."""

    name: str
    aliases: tuple[str, ...]
    points: int
    metadata: Mapping[str, Any]


def open_client(settings: Settings) -> QdrantClient:
    """A Qdrant client: a server when ``QUARRY_QDRANT_URL`` is set, else local mode on disk."""
    if settings.qdrant_url:
        return _server_client(settings.qdrant_url, settings.qdrant_api_key, settings.collection)
    make_data_folder(settings.data_dir, settings.qdrant_path, "local-mode Qdrant")
    try:
        client = QdrantClient(path=str(settings.qdrant_path))
        tune_local_storage(client)
        return client
    except RuntimeError as error:
        if "already accessed" in str(error):
            raise local_mode_locked(settings) from error
        raise
    except LOCAL_STORAGE_ERRORS as error:
        raise local_mode_unreadable(settings, error) from error


# What reading a damaged local-mode folder raises: a truncated meta.json, a corrupt or
# truncated SQLite file, a point that no longer unpickles.
LOCAL_STORAGE_ERRORS = (ValueError, OSError, sqlite3.DatabaseError, EOFError, pickle.PickleError)


def local_mode_unreadable(settings: Settings, error: BaseException) -> StoreError:
    """The error for a local-mode Qdrant folder that cannot be read: damaged, or not
    this process's to open (permissions, a read-only or full disk)."""
    where = f"local-mode Qdrant at {settings.qdrant_path}"
    if isinstance(error, OSError) and error.errno in _NOT_DAMAGE:
        return StoreError(settings.collection, f"{where} cannot be opened: {error}")
    if isinstance(error, ValidationError):  # another qdrant-client version wrote it?
        return StoreError(
            settings.collection,
            f"{where} holds what this qdrant-client cannot read (written by another "
            f"version?): {error}",
        )
    return StoreError(
        settings.collection,
        f"{where} cannot be read ({type(error).__name__}: {error}): restore the folder "
        "from a backup, or move it away and ingest again to build it anew",
    )


_NOT_DAMAGE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EMFILE, errno.ENFILE}


def _server_client(url: str, api_key: SecretStr | None, collection: str) -> QdrantClient:
    """A client for the Qdrant server at ``url``, checked to answer before it is used.

    Without the check, the first call of whatever command fails deep inside
    qdrant-client with a traceback that never names the setting.
    """
    key = api_key.get_secret_value() if api_key else None
    # qdrant-client warns when it cannot read the server's version; an unreachable
    # server gets a clearer error below, a reachable one gets its warnings back.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = QdrantClient(url=url, api_key=key, timeout=60)
    try:
        client.get_collections()
    except Exception as error:  # transport-specific types (httpx, grpc, HTTP status)
        client.close()
        reason = getattr(error, "reason_phrase", None) or str(error) or type(error).__name__
        raise StoreError(
            collection, f"Qdrant at {url} (QUARRY_QDRANT_URL) does not answer: {reason}"
        ) from None
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return client


def local_mode_locked(settings: Settings) -> StoreLocked:
    """The error for a local-mode Qdrant folder that another process holds."""
    return StoreLocked(
        settings.collection,
        f"local-mode Qdrant at {settings.qdrant_path} is in use by another quarry "
        "process (local mode admits one process at a time). Wait for it to finish, "
        "or run a Qdrant server and set QUARRY_QDRANT_URL so several processes "
        "(an ingest and the API) can share the index.",
    )


def writer_lock_path(settings: Settings) -> Path:
    """The file lock that serialises quarry's writers (ingest, reindex) on local-mode Qdrant."""
    return settings.data_dir / "locks" / "local-qdrant.lock"


def writer_lock_held(settings: Settings) -> bool:
    """Whether an ingest or reindex holds the writers' lock right now (it is waited for)."""
    from filelock import FileLock, Timeout

    lock_path = writer_lock_path(settings)
    if not lock_path.is_file():
        return False
    try:
        FileLock(str(lock_path)).acquire(timeout=0).lock.release()
    except Timeout:
        return True
    return False


def local_store_held(settings: Settings) -> bool:
    """Whether a process holds local-mode Qdrant's folder right now (the ``.lock`` file
    qdrant-client locks while a client is open), read without opening the store."""
    lock_path = settings.qdrant_path / ".lock"
    if not lock_path.is_file():
        return False
    import portalocker  # as qdrant-client does: only where local mode is used

    with open(lock_path, "r+") as handle:
        try:
            portalocker.lock(
                handle, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING
            )
        except portalocker.exceptions.LockException:
            return True
        portalocker.unlock(handle)
    return False


def tune_local_storage(client: QdrantClient) -> None:
    """Put local-mode Qdrant's SQLite files in WAL mode with ``synchronous=NORMAL``.

    Local mode commits once per point; with SQLite's default rollback journal each
    commit waits for the disk (about 17 ms a point here), which made an on-disk
    ingest twenty times slower than embedding. WAL keeps every commit atomic and
    survives a killed process; only an OS crash can lose the last commits, which
    the next sync re-does because the index is the ledger. Reaches into
    qdrant-client's local internals, so it does nothing if they change.
    """
    local = getattr(client, "_client", None)
    for collection in (getattr(local, "collections", None) or {}).values():
        connection = getattr(getattr(collection, "storage", None), "storage", None)
        if isinstance(connection, sqlite3.Connection):
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")


class _CommitLater:
    """A SQLite connection whose ``with`` block neither commits nor rolls back.

    qdrant-client's local persistence writes each point inside ``with
    connection:``, a commit per point. Behind this stand-in the points of one
    upsert go into one transaction that :func:`_one_transaction` ends.
    """

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def __enter__(self) -> sqlite3.Connection:
        return self.connection

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # execute and the rest: the real connection's
        return getattr(self.connection, name)


@contextmanager
def _one_transaction(client: QdrantClient, collection: str) -> Iterator[None]:
    """Commit local mode's writes to ``collection`` once, on leaving the block.

    A commit costs about 0.15 ms even in WAL mode, as much as the rest of a
    point's write. qdrant-client writes each point to SQLite before it applies
    it in memory; when the upsert fails midway, what it applied is committed
    too, so the disk holds what this process's memory holds, as with its own
    per-point commits. (If the commit itself fails, memory holds points the
    disk lacks until the process ends; the upsert raises, and the next sync
    re-embeds those documents.) A process killed mid-upsert leaves none of it.
    Does nothing for a server, or if qdrant-client's local internals change.
    """
    local = getattr(client, "_client", None)
    aliases = getattr(local, "aliases", None) or {}
    collections = getattr(local, "collections", None) or {}
    target = collections.get(collection) or collections.get(aliases.get(collection, ""))
    persistence: Any = getattr(target, "storage", None)
    connection = getattr(persistence, "storage", None)
    if not isinstance(connection, sqlite3.Connection) or connection.in_transaction:
        yield
        return
    persistence.storage = _CommitLater(connection)
    try:
        yield
    finally:
        persistence.storage = connection
        try:
            connection.commit()
        except BaseException:
            connection.rollback()
            raise


def physical_name(alias: str, model_key: str, when: datetime | None = None) -> str:
    """``<alias>__<model_key>__<UTC yyyymmddHHMMSS>``."""
    stamp = (when or datetime.now(UTC)).strftime("%Y%m%d%H%M%S")
    return f"{alias}__{model_key}__{stamp}"


def not_an_alias(name: str) -> str:
    """What is wrong when ``name``, given as the alias, is a physical collection's name."""
    owner = name.split("__", 1)[0]
    hint = f"; pass its alias (--collection {owner})" if owner != name else ""
    return (
        f"{name!r} is a collection, not an alias: quarry reads and writes through an "
        f"alias (--collection or QUARRY_COLLECTION){hint}; "
        f"`quarry status --collection {name}` shows it"
    )


class VectorStore:
    """One alias in Qdrant and the physical collection it points at."""

    def __init__(self, client: QdrantClient, alias: str, *, pinned: str | None = None) -> None:
        self.client = client
        self.alias = alias
        self.pinned = pinned
        # Local-mode Qdrant is not safe for concurrent writers inside one process.
        self._write_lock = threading.Lock()
        # QdrantClient.upsert first walks every point looking for inputs to embed with
        # fastembed (models.Document), ~15 us a point; quarry's points carry their
        # vectors, so upserts go to the transport client (local or remote) it wraps.
        self._writer: Any = getattr(client, "_client", client)

    @property
    def is_local(self) -> bool:
        """True for local-mode Qdrant (files in this process), False for a server."""
        return type(getattr(self.client, "_client", None)).__name__ == "QdrantLocal"

    def view(self, physical: str) -> VectorStore:
        """The same store, but reading and writing ``physical`` instead of the alias's target.

        A reindex builds its new collection through such a view while the alias
        still serves the old one.
        """
        view = VectorStore(self.client, self.alias, pinned=physical)
        view._write_lock = self._write_lock
        return view

    # -- collections and aliases ----------------------------------------------------------

    def resolve(self) -> str | None:
        """The physical collection behind the alias (or the pinned one), None when none."""
        if self.pinned is not None:
            return self.pinned
        return self.alias_target()

    def exists(self) -> bool:
        """True when the alias points at a collection."""
        return self.resolve() is not None

    def create_physical(
        self,
        fingerprint: Fingerprint,
        chunking: Mapping[str, Any],
        name: str | None = None,
        *,
        extra_metadata: Mapping[str, Any] | None = None,
    ) -> str:
        """Create a new physical collection for ``fingerprint``; does not touch the alias.

        ``extra_metadata`` is stored with it from the start (a reindex marks its
        build as under way, so a build that was killed says so).
        """
        if name is None:
            # Names are stamped to the second; two rebuilds within one take the next free one.
            when = datetime.now(UTC)
            name = physical_name(self.alias, fingerprint.model_key, when)
            while self.client.collection_exists(name):
                when += timedelta(seconds=1)
                name = physical_name(self.alias, fingerprint.model_key, when)
        self.client.create_collection(
            name,
            vectors_config=models.VectorParams(
                size=fingerprint.model.dimensions, distance=models.Distance.DOT
            ),
            metadata={
                META_FINGERPRINT: fingerprint.to_metadata(),
                META_CHUNKING: dict(chunking),
                META_ACCEPTED_SERVING: [],
                "quarry_alias": self.alias,
                **(extra_metadata or {}),
            },
        )
        if self.is_local:
            tune_local_storage(self.client)
        else:  # local mode has no payload indexes (and warns if asked)
            for field_name, schema in INDEXED_FIELDS.items():
                self.client.create_payload_index(name, field_name, field_schema=schema, wait=True)
        return name

    def alias_target(self) -> str | None:
        """Where the alias points now (ignores a pinned view)."""
        for alias in self.client.get_aliases().aliases:
            if alias.alias_name == self.alias:
                return alias.collection_name
        return None

    def point_alias(self, physical: str) -> None:
        """Point the alias at ``physical`` in one atomic alias update."""
        operations: list[models.CreateAliasOperation | models.DeleteAliasOperation] = []
        if self.alias_target() is not None:
            operations.append(
                models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=self.alias))
            )
        operations.append(
            models.CreateAliasOperation(
                create_alias=models.CreateAlias(collection_name=physical, alias_name=self.alias)
            )
        )
        self.client.update_collection_aliases(change_aliases_operations=operations)

    def create(self, fingerprint: Fingerprint, chunking: Mapping[str, Any]) -> str:
        """Create the first physical collection and point the alias at it.

        ConfigError when the alias's name is taken by a collection (a physical
        collection's name given as the alias): nothing is created.
        """
        self.refuse_a_collection_name()
        physical = self.create_physical(fingerprint, chunking)
        try:
            self.point_alias(physical)
        except BaseException:
            self.client.delete_collection(physical)  # no orphan left behind
            raise
        return physical

    def metadata(self, physical: str | None = None) -> dict[str, Any]:
        """The collection's metadata (empty when it has none)."""
        name = physical or self._require()
        return dict(self.client.get_collection(name).config.metadata or {})

    def vector_size(self, physical: str | None = None) -> int | None:
        """The size of the collection's (unnamed) dense vectors; None for named vectors."""
        vectors = self.client.get_collection(physical or self._require()).config.params.vectors
        return vectors.size if isinstance(vectors, models.VectorParams) else None

    def update_metadata(self, values: Mapping[str, Any], physical: str | None = None) -> None:
        """Set top-level metadata keys (others are kept)."""
        self.client.update_collection(physical or self._require(), metadata=dict(values))

    def source_records(self) -> dict[str, Any]:
        """What each folder source was last synced from (see META_SOURCES), by name; empty
        when the collection does not exist or recorded none."""
        return self._stored_sources() if self.exists() else {}

    def record_sources(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """Add or replace the records of these sources (the others are kept); nothing
        without a collection, and no write when they are as recorded (a nightly
        re-ingest of the same folders changes nothing)."""
        if not self.exists():
            return
        current = self._stored_sources()
        changed = {name: dict(r) for name, r in records.items() if current.get(name) != r}
        if changed:
            self.update_metadata({META_SOURCES: {**current, **changed}})

    def _stored_sources(self) -> dict[str, Any]:
        records = self.metadata().get(META_SOURCES)
        return dict(records) if isinstance(records, Mapping) else {}

    def fingerprint(self, physical: str | None = None) -> Fingerprint | None:
        """The stored fingerprint, or None for a collection quarry did not create."""
        data = self.metadata(physical).get(META_FINGERPRINT)
        return Fingerprint.from_metadata(data) if data else None

    def collections(self) -> list[CollectionInfo]:
        """Every physical collection that belongs to this alias, newest first.

        Those named as :func:`physical_name` names them for this alias exactly (an
        alias ``team__archive`` is another alias's, not ``team``'s), and any the
        alias points at.
        """
        names, aliases = self._own_collections()
        found = [
            CollectionInfo(
                name=name,
                aliases=tuple(aliases.get(name, [])),
                points=self.client.count(name, exact=True).count,
                metadata=self.metadata(name),
            )
            for name in names
        ]
        return sorted(found, key=lambda info: info.name.rsplit("__", 1)[-1], reverse=True)

    def physical_names(self) -> list[str]:
        """The names :meth:`collections` lists, without counting their points."""
        return self._own_collections()[0]

    def _own_collections(self) -> tuple[list[str], dict[str, list[str]]]:
        """This alias's physical collection names, and every collection's aliases."""
        own = re.compile(re.escape(self.alias) + r"__[0-9a-f]+__\d{14}")
        aliases: dict[str, list[str]] = {}
        for alias in self.client.get_aliases().aliases:
            aliases.setdefault(alias.collection_name, []).append(alias.alias_name)
        names = [
            description.name
            for description in self.client.get_collections().collections
            if own.fullmatch(description.name) or self.alias in aliases.get(description.name, [])
        ]
        return names, aliases

    def drop(self, physical: str) -> None:
        """Delete a physical collection; never the one the alias points at."""
        if physical == self.alias_target():
            raise StoreError(self.alias, f"{physical} is what the alias serves; not deleting it")
        self.client.delete_collection(physical)

    def discard(self) -> None:
        """Delete the collection the alias serves, and the alias with it: for a derived
        collection (an evaluation's) to be built again from its source."""
        physical = self.alias_target()
        if physical is not None:
            self.client.delete_collection(physical)  # Qdrant drops its aliases with it

    def refuse_a_collection_name(self) -> None:
        """ConfigError when the alias's name is a physical collection's, not an alias's
        (a build that ``quarry collections`` lists, given as ``--collection``)."""
        if self.pinned is None and self.client.collection_exists(self.alias):
            raise ConfigError(not_an_alias(self.alias))

    def _require(self) -> str:
        physical = self.resolve()
        if physical is None:
            self.refuse_a_collection_name()
            raise StoreError(self.alias, "does not exist yet; run `quarry ingest PATH` first")
        return physical

    # -- reading ---------------------------------------------------------------------------

    def count(self, physical: str | None = None) -> int:
        """Exact number of points."""
        return self.client.count(physical or self._require(), exact=True).count

    def index_state(self, source: str | None = None) -> dict[str, DocState]:
        """Per-document state from the points themselves, optionally for one source."""
        states: dict[str, DocState] = {}
        payloads: Iterable[Mapping[str, Any]]
        if self.is_local:
            in_place = self._local_payloads(self._require())
            if in_place is not None:
                payloads = in_place
            else:
                # Local mode evaluates a filter in Python on every point, once per page:
                # one unfiltered page of everything, filtered here, is several times faster.
                records = self.scroll(fields=_SCAN_FIELDS, page=self.count() + 1)
                payloads = (point.payload or {} for point in records)
            if source is not None:
                payloads = (p for p in payloads if p.get("source") == source)
        else:
            query_filter = None
            if source is not None:
                query_filter = models.Filter(
                    must=[
                        models.FieldCondition(key="source", match=models.MatchValue(value=source))
                    ]
                )
            records = self.scroll(query_filter=query_filter, fields=_SCAN_FIELDS)
            payloads = (point.payload or {} for point in records)
        for payload in payloads:
            doc_id = str(payload.get("doc_id"))
            state = states.get(doc_id)
            if state is None:
                state = states[doc_id] = DocState(doc_id=doc_id, uri=str(payload.get("uri")))
            state.hashes.add(str(payload.get("doc_hash")))
            state.chunk_counts.add(int(payload.get("chunk_count", -1)))
            state.indexes.add(int(payload.get("chunk_index", -1)))
            state.stamps.add(FileStamp.from_metadata(payload.get("metadata") or {}))
            chunking = payload.get("chunking")
            state.chunkings.add(chunking if isinstance(chunking, str) else None)
            state.points += 1
        return states

    def _local_payloads(self, physical: str) -> Iterator[Mapping[str, Any]] | None:
        """The live payloads of a local-mode collection, read in place; None if unavailable.

        A local-mode scroll deep-copies every payload it returns, and on a re-ingest
        that copy was most of the run. This reads qdrant-client's in-process
        collection (its ``payload`` list and ``deleted`` flags) without copying or
        changing anything; with any other layout it returns None and the caller
        scrolls. tests/test_store.py checks both ways give the same state.
        """
        local = getattr(self.client, "_client", None)
        collections = getattr(local, "collections", None)
        collection = collections.get(physical) if isinstance(collections, dict) else None
        payloads = getattr(collection, "payload", None)
        deleted = getattr(collection, "deleted", None)
        if not isinstance(payloads, list) or deleted is None:
            return None
        flags = deleted.tolist()
        if len(flags) != len(payloads):
            return None
        # A slice, so a point appended while this is read is not half seen.
        return (
            payload
            for payload, gone in zip(payloads[: len(flags)], flags, strict=True)
            if not gone and isinstance(payload, Mapping)
        )

    def scroll(
        self,
        *,
        query_filter: models.Filter | None = None,
        fields: Sequence[str] | bool = True,
        with_vectors: bool = False,
        physical: str | None = None,
        page: int = 1024,
    ) -> Iterator[models.Record]:
        """Every point matching ``query_filter``, page by page."""
        name = physical or self._require()
        offset: Any = None
        selector: Any = list(fields) if not isinstance(fields, bool) else fields
        while True:
            records, offset = self.client.scroll(
                name,
                scroll_filter=query_filter,
                limit=page,
                offset=offset,
                with_payload=selector,
                with_vectors=with_vectors,
            )
            yield from records
            if offset is None:
                return

    def retrieve(
        self, ids: Sequence[str], fields: Sequence[str], *, with_vectors: bool = False
    ) -> list[models.Record]:
        """The points ``ids`` that exist, by id (no filter: local mode scans nothing)."""
        if not ids:
            return []
        return self.client.retrieve(
            self._require(), ids=list(ids), with_payload=list(fields), with_vectors=with_vectors
        )

    def search(
        self, vector: Sequence[float], limit: int, query_filter: models.Filter | None = None
    ) -> list[models.ScoredPoint]:
        """Nearest points by cosine."""
        return self.client.query_points(
            self._require(),
            query=unit_vector(vector),
            limit=limit,
            query_filter=query_filter,
            with_payload=SEARCH_FIELDS,
        ).points

    # -- writing ---------------------------------------------------------------------------

    def upsert(self, points: Sequence[models.PointStruct], physical: str | None = None) -> None:
        """Write points and wait; anything but a completed update raises WriteFailed."""
        if not points:
            return
        name = physical or self._require()
        with self._write_lock:
            try:
                with _one_transaction(self.client, name):
                    result = self._writer.upsert(name, points=list(points), wait=True)
            except Exception as error:  # qdrant-client raises transport-specific types
                raise _write_failed(name, f"upsert of {len(points)} points", error) from error
        if result.status != models.UpdateStatus.COMPLETED:
            raise WriteFailed(name, f"upsert of {len(points)} points ended {result.status}")

    def update_points_metadata(
        self, updates: Sequence[tuple[Sequence[str], Mapping[str, Any]]]
    ) -> None:
        """Set fields inside the ``metadata`` payload of several groups of points, each
        group its own (a file stamp, say), in one request; the rest of each payload stays."""
        operations = [
            models.SetPayloadOperation(
                set_payload=models.SetPayload(
                    payload=dict(fields), points=list(ids), key="metadata"
                )
            )
            for ids, fields in updates
            if ids
        ]
        if not operations:
            return
        name = self._require()
        what = f"updating the metadata of {sum(len(ids) for ids, _ in updates)} points"
        with self._write_lock:
            try:
                with _one_transaction(self.client, name):
                    self._writer.batch_update_points(name, update_operations=operations, wait=True)
            except Exception as error:  # qdrant-client raises transport-specific types
                raise _write_failed(name, what, error) from error

    def set_payload_fields(self, ids: Sequence[str], fields: Mapping[str, Any]) -> None:
        """Set the top-level payload ``fields`` of the points ``ids``, leaving the rest."""
        if not ids:
            return
        name = self._require()
        with self._write_lock:
            try:
                with _one_transaction(self.client, name):
                    self._writer.set_payload(
                        name, payload=dict(fields), points=list(ids), wait=True
                    )
            except Exception as error:  # qdrant-client raises transport-specific types
                raise _write_failed(name, f"updating {len(ids)} points", error) from error

    def delete_stale_chunks(self, doc_id: str, chunk_count: int) -> None:
        """Delete a document's points from ``chunk_count`` on (left over from a longer version)."""
        self._delete(
            models.Filter(
                must=[
                    models.FieldCondition(key="doc_id", match=models.MatchValue(value=doc_id)),
                    models.FieldCondition(key="chunk_index", range=models.Range(gte=chunk_count)),
                ]
            )
        )

    def delete_points(self, ids: Sequence[str]) -> None:
        """Delete points by id (a missing id is no error)."""
        if ids:
            self._delete(models.PointIdsList(points=list(ids)))

    def delete_documents(self, doc_ids: Sequence[str]) -> None:
        """Delete every point of the given documents."""
        if doc_ids:
            self._delete(
                models.Filter(
                    must=[
                        models.FieldCondition(
                            key="doc_id", match=models.MatchAny(any=list(doc_ids))
                        )
                    ]
                )
            )

    def _delete(self, selector: models.Filter | models.PointIdsList) -> None:
        name = self._require()
        points = (
            models.FilterSelector(filter=selector)
            if isinstance(selector, models.Filter)
            else selector
        )
        with self._write_lock:
            try:
                result = self.client.delete(name, points_selector=points, wait=True)
            except Exception as error:
                raise _write_failed(name, "delete", error) from error
        if result.status != models.UpdateStatus.COMPLETED:
            raise WriteFailed(name, f"delete ended {result.status}")

    def close(self) -> None:
        """Close the client (releases local mode's folder lock)."""
        self.client.close()
