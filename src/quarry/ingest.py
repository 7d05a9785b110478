"""The sync algorithm: plan from the index, embed, write, clean. No Prefect here.

The index is the ledger: whether a document is current is read from its own
points (``doc_hash``, ``chunk_count`` and which chunk indexes exist). Writes go
new-points-first, stale-points-after, with deterministic point ids, so a run
killed at any moment and run again converges on the same index as one clean run.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from qdrant_client import models

from quarry.chunking import Chunker
from quarry.documents import Chunk, Document, FileStamp, point_id
from quarry.embeddings import EmbeddedPart, EmbeddingClient, EmbedFailure, EmbedResult, Vector
from quarry.errors import (
    ConfigError,
    FingerprintMismatch,
    MassDeleteRefused,
    QuarryError,
    SourceNotFound,
    StoreUnavailable,
    VectorsOfAnotherSize,
    WriteFailed,
)
from quarry.fingerprint import (
    Fingerprint,
    build_fingerprint,
    check_compatible,
    read_fingerprint,
)
from quarry.sources import (
    DEFAULT_EXCLUDE,
    DEFAULT_INCLUDE,
    LOADER_VERSION,
    Listing,
    LoadFailure,
    SourceSpec,
    UnchangedFile,
    file_mtime,
    file_source,
    iter_documents,
    list_source,
    refuse_overlapping_sources,
    subfolder_source,
    without_parts_taken_in,
)
from quarry.store import META_ACCEPTED_SERVING, META_CHUNKING, DocState, VectorStore

UPSERT_BATCH = 256
# Documents whose new file stamps go in one request (see IndexSync.refresh_stamp).
STAMP_BATCH = 512
STAMP_BATCH_POINTS = 20_000  # and at most this many points (a request's size)
# A document of more chunks than this is embedded and written a window at a time
# (see IndexSync._write_long); at 1024 dimensions a window's vectors are 16 MB.
LONG_DOCUMENT_CHUNKS = 4096
LONG_DOCUMENT_WINDOW = 4096
# The chunk_count of a long document's points while it is being written, once the
# service split a chunk (no document has it, so none reads as complete with it).
CHUNK_COUNT_PENDING = -1
# Stored points read per request when a re-written document's vectors are reused.
REUSE_READ_PAGE = 1024
_REUSE_FIELDS = (
    "doc_id",
    "text",
    "headings",
    "token_count",
    "char_start",
    "chunking",
    "model_key",
    "split_of",
    "part_index",
    "part_chars",
)
# A batch of documents is the unit of parallel work (one Prefect task): big enough
# that scheduling is noise, small enough that a failure or a retry costs little.
BATCH_DOCUMENTS = 64
BATCH_CHARACTERS = 2_000_000
# How long a run that is ending waits for its batches in flight to return.
WIND_DOWN_SECONDS = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Failure:
    """A document that could not be indexed, and why."""

    uri: str
    error: str


@dataclass(slots=True)
class BatchResult:
    """What writing one batch of documents did."""

    documents_embedded: int = 0
    documents_added: int = 0  # of those embedded, the ones the collection did not hold
    chunks_embedded: int = 0
    tokens_embedded: int = 0
    # Chunks of re-written documents whose text the collection already held a vector for.
    chunks_reused: int = 0
    # Points of re-embedded documents beyond their new chunk count (they got shorter).
    chunks_deleted: int = 0
    failures: list[Failure] = field(default_factory=list)


@dataclass(slots=True)
class IngestReport:
    """The summary of a run; ``to_dict`` is the ``--json`` shape."""

    collection: str
    documents_seen: int = 0
    documents_skipped: int = 0
    # Files not even read: their mtime and size were those their documents came from.
    files_unread: int = 0
    documents_embedded: int = 0
    # Of the embedded: new to the collection, and written again (their text or metadata
    # changed, or the chunk settings did).
    documents_added: int = 0
    documents_updated: int = 0
    documents_deleted: int = 0
    documents_failed: int = 0
    chunks_embedded: int = 0
    chunks_reused: int = 0
    chunks_deleted: int = 0
    tokens_embedded: int = 0
    embedding_requests: int = 0
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, result: BatchResult) -> None:
        """Fold a batch's result into the totals."""
        self.documents_embedded += result.documents_embedded
        self.documents_added += result.documents_added
        self.documents_updated += result.documents_embedded - result.documents_added
        self.chunks_embedded += result.chunks_embedded
        self.chunks_reused += result.chunks_reused
        self.chunks_deleted += result.chunks_deleted
        self.tokens_embedded += result.tokens_embedded
        self.fail(result.failures)

    def fail(self, failures: Iterable[Failure]) -> None:
        """Record failures."""
        for failure in failures:
            self.failures.append(failure)
            self.documents_failed += 1

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` shape in docs/json.md (fields may be added, never renamed)."""
        data = asdict(self)
        data["failures"] = [asdict(failure) for failure in self.failures]
        return data


@dataclass(frozen=True, slots=True)
class IngestProgress:
    """How far a run has got, for a progress line or a log line."""

    files_done: int  # files unchanged, failed to load, or with their documents written
    files_found: int  # files found in the sources walked so far
    documents_embedded: int
    chunks_embedded: int
    documents_failed: int

    def describe(self) -> str:
        """One line, e.g. ``340 of 1,200 files done; embedded 300 documents (620 chunks)``."""
        line = (
            f"{self.files_done:,} of {self.files_found:,} files done; embedded "
            f"{self.documents_embedded:,} documents ({self.chunks_embedded:,} chunks)"
        )
        if self.documents_failed:
            line += f"; {self.documents_failed:,} failed"
        return line


PROGRESS_SECONDS = 30.0
"""A long run says how far it has got at most this often."""
PROGRESS_TICK_SECONDS = 1.0
"""How often a run passes its progress on while it waits for a batch or checks files
(the callback decides what to show: a live line, a log line every PROGRESS_SECONDS)."""


def every(seconds: float) -> Callable[[], bool]:
    """A gate for progress lines: open on the first call, then once ``seconds`` have
    passed since it last opened."""
    last = -math.inf

    def due() -> bool:
        nonlocal last
        now = time.monotonic()
        if now - last < seconds:
            return False
        last = now
        return True

    return due


@dataclass(slots=True)
class _FileTally:
    found: int = 0
    checked: int = 0  # compared with the index (read or not)
    done: int = 0  # as last reported


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """What a sync of one source will do, decided before any embedding."""

    spec: SourceSpec
    state: Mapping[str, DocState]
    # The stored documents of each file (a PDF has one per page), by file uri.
    files: Mapping[str, list[DocState]] = field(default_factory=dict)
    # The source's files as walked for the plan; loading reuses the walk.
    listing: Listing | None = None


class IndexSync:
    """Keeps one collection in step with its sources through one embedding service."""

    def __init__(
        self,
        store: VectorStore,
        embedder: EmbeddingClient,
        chunker: Chunker,
        *,
        embed_headings: bool = False,
        max_delete_fraction: float = 0.3,
        allow_serving_change: bool = False,
        canary_min_cosine: float = 0.999,
        trust_file_stamps: bool = True,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.chunker = chunker
        self.embed_headings = embed_headings
        self.max_delete_fraction = max_delete_fraction
        self.allow_serving_change = allow_serving_change
        self.canary_min_cosine = canary_min_cosine
        # Skip reading files whose mtime and size are as indexed (QUARRY_TRUST_FILE_STAMPS).
        self.trust_file_stamps = trust_file_stamps
        self.fingerprint: Fingerprint | None = None
        # Each point records the settings that made it (``chunking``: the chunker's and
        # whether headings were embedded); points written before that was recorded were
        # made by the collection's META_CHUNKING.
        self.settings = index_settings(chunker.settings, embed_headings)
        self.chunking_key = chunking_key(self.settings)
        self.rechunk_all = False  # META_CHUNKING differs: documents re-chunk as syncs reach them
        self._unkeyed_current = True  # whether points without a key have today's settings
        # Whether the points made with a settings key (None: none recorded) were embedded
        # with their headings: what a stored vector was made from, for reuse.
        self._headings_by_key: dict[str | None, bool] = {
            self.chunking_key: embed_headings,
            None: embed_headings,
        }
        self._requests_at_start = 0
        # What the plans read: the sources scanned and the documents that had points then.
        self._planned_sources: set[str] = set()
        self._planned_documents: dict[str, DocState] = {}
        # The chunk indexes a document has now, where this run knows them: as its plan
        # read them, then as this run wrote them. A stale chunk is deleted by point id.
        self._known_indexes: dict[str, set[int]] = {}
        # Set when this run created the collection: no document has points it did not write.
        self._created_collection = False
        # File stamps to write (state, stamp, point ids, metadata, uri): see refresh_stamp.
        self._stamps_due: list[tuple[DocState, FileStamp, list[str], dict[str, Any], str]] = []
        self._stamp_points_due = 0
        # Chunks embedded and written of long documents not finished yet (for progress).
        self._chunks_under_way = 0
        self._under_way_lock = threading.Lock()
        # The canary of an existing collection is checked before the first embedding.
        self._canary_lock = threading.Lock()
        self._stored: Fingerprint | None = None
        self._accepted_serving: list[Mapping[str, Any]] = []
        self._canary_error: QuarryError | None = None
        # The embedding client's interruptions count when the model was last judged, and
        # what the collection holds to judge it against (its stored fingerprint, or the
        # one this run created it with).
        self._interruptions_judged = 0
        self._judged_against: Fingerprint | None = None
        # Set when the run is ending (Ctrl-C, a failure): batches write nothing more.
        # The condition guards the count of writes under way, which stop() waits out.
        self._stopping = threading.Event()
        self._writing = threading.Condition()
        self._writes_under_way = 0

    # -- before: fingerprint and plan ----------------------------------------------------

    def prepare(self, report: IngestReport) -> Fingerprint:
        """Check the live service against the collection, or create the collection.

        ``/info`` settles model and serving identity here. The canary (an embedding
        request) is checked just before the first passage is embedded
        (:meth:`verify_canary`), so a run with nothing to embed sends no embedding
        request at all, and a run that does embed writes nothing until it passes.
        """
        self._requests_at_start = self.embedder.requests_sent
        self._interruptions_judged = self.embedder.interruptions
        if not self.store.exists():
            live = read_fingerprint(self.embedder)
            self.store.create(live, self.settings)
            self._created_collection = True
            report.notes.append(
                f"created collection {self.store.alias!r} for {live.model.describe()}"
            )
            self.fingerprint = self._judged_against = live
            return self._expecting(live)
        stored = self.store.fingerprint()
        if stored is None:
            # A collection quarry did not create: nothing to compare with.
            self.fingerprint = self._judged_against = read_fingerprint(self.embedder)
            return self._expecting(self.fingerprint)
        metadata = self.store.metadata()
        self._accepted_serving = list(metadata.get(META_ACCEPTED_SERVING) or [])
        # What the service claims, with the stored canary standing in for its own:
        # dimensions and normalisation are the stored ones until the canary is read.
        claimed = build_fingerprint(
            self.embedder.info, stored.canary, self.embedder.profile.name, self.embedder.query_task
        )
        try:
            self._check(stored, claimed)
        except FingerprintMismatch as refused:
            # Another model: refused either way, but the claim carries the stored size and
            # so a key no collection has. Name the live model as it is (one canary request).
            try:
                live = read_fingerprint(self.embedder)
            except QuarryError:
                raise refused from None
            self._check(stored, live)  # raises, describing the live model truly
            claimed = live  # its vectors say otherwise after all: judged on them
        self._stored = self._judged_against = stored
        recorded = metadata.get(META_CHUNKING)
        if recorded is not None:
            recorded_headings = bool(recorded.get("embed_headings", False))
            self._headings_by_key[None] = recorded_headings
            self._headings_by_key.setdefault(chunking_key(recorded), recorded_headings)
        if recorded is not None and dict(recorded) != self.settings:
            self.rechunk_all = True
            self._unkeyed_current = False
            report.notes.append(
                f"chunking settings changed ({_changes(recorded, self.settings)}): each "
                "document made with the old settings is re-chunked when a sync reaches it, "
                "and its chunks whose text changed are re-embedded"
            )
        self.fingerprint = claimed
        return self._expecting(claimed)

    def _expecting(self, fingerprint: Fingerprint) -> Fingerprint:
        """Tell the embedder the size of the vectors the collection takes."""
        self.embedder.dimensions = fingerprint.model.dimensions
        return fingerprint

    def verify_canary(self) -> None:
        """Embed the canary and compare it with the stored one, once per run.

        Raises CanaryMismatch (or FingerprintMismatch, when the vectors' size or
        normalisation changed) before anything is written; every later call
        raises the same error without asking the service again.
        """
        with self._canary_lock:
            if self._canary_error is not None:
                raise self._canary_error
            if self._stored is None:
                return
            live = read_fingerprint(self.embedder)
            try:
                self._check(self._stored, live)
            except QuarryError as error:
                self._canary_error = error
                raise
            self.fingerprint = live
            self._stored = None

    def judge_after_interruption(self, *, because: str | None = None) -> None:
        """Judge the model again if the embedding service was unreachable or down since it
        was last judged: a restart may have brought it back as another model (an image
        or ``--model-id`` changed while a run was under way), whose vectors must not be
        written beside the ones already stored. Raises as :meth:`verify_canary` does,
        before the batch that saw it writes anything; every later call raises the same.
        ``because`` judges it whatever the interruptions, and says why in the refusal.
        """
        if because is None and self.embedder.interruptions == self._interruptions_judged:
            return
        with self._canary_lock:
            if self._canary_error is not None:
                raise self._canary_error
            seen = self.embedder.interruptions
            if because is None and seen == self._interruptions_judged:
                return  # another batch judged it meanwhile
            against = self._judged_against
            assert against is not None, "prepare() must run first"
            self.embedder.refresh_info()
            live = read_fingerprint(self.embedder)
            try:
                self._check(against, live)
            except QuarryError as error:
                error.add_note(
                    because
                    or "the embedding service was unreachable or down during the run and "
                    "came back serving this; nothing embedded since then was written"
                )
                self._canary_error = error
                raise
            self._interruptions_judged = seen

    def _embed(self, texts: list[str], documents: list[str]) -> list[EmbedResult]:
        """Embed passages; vectors of another size than the index's get the model judged
        again (another model behind the URL is refused, naming it), else fail as they are."""
        try:
            return self.embedder.embed_passages(texts, documents=documents)
        except VectorsOfAnotherSize:
            self.judge_after_interruption(
                because="the embedding service answered vectors of another size during the "
                "run, serving this; nothing embedded since then was written"
            )
            raise

    def _check(self, stored: Fingerprint, live: Fingerprint) -> None:
        check_compatible(
            stored,
            live,
            collection=self.store.alias,
            accepted_serving=self._accepted_serving,
            allow_serving_change=self.allow_serving_change,
            min_canary_cosine=self.canary_min_cosine,
        )

    def plan_source(
        self, spec: SourceSpec, *, full_sync: bool, allow_mass_delete: bool
    ) -> SourcePlan:
        """Scan the index for ``spec``'s documents and refuse a mass delete before any work.

        The check here is by file (cheap: no file is read); :meth:`clean_source`
        checks again by document once every file has been loaded.
        """
        state = self.plan_documents(spec.name)
        if spec.file is not None:
            # One file of a folder: the folder's other files are not this sync's business.
            own = spec.uri_prefix + spec.file
            state = {k: doc for k, doc in state.items() if _file_uri(doc.uri) == own}
        elif spec.within is not None:  # one subfolder: nor are the files around it
            under = spec.uri_prefix + spec.within
            state = {k: doc for k, doc in state.items() if doc.uri.startswith(under)}
        files: dict[str, list[DocState]] = {}
        for doc in state.values():
            files.setdefault(_file_uri(doc.uri), []).append(doc)
        listing = list_source(spec)
        if full_sync and files:
            found, unlisted = listing.still_there()
            gone = sum(1 for uri in files if uri not in found and not uri.startswith(unlisted))

            def outcome() -> str:
                new = listing.files_to_index(files)
                moved = (
                    f" {new} files were found that are not indexed: if they are those files "
                    "moved or renamed, --allow-mass-delete indexes them under their new names."
                    if new
                    else ""
                )
                return f"{moved} Nothing of {_scope(spec)} was read, embedded or deleted."

            self._guard_deletes(
                spec, gone, len(files), allow_mass_delete, unit="files", outcome=outcome
            )
        return SourcePlan(spec=spec, state=state, files=files, listing=listing)

    def assume_empty(self) -> None:
        """Say that the collection was created empty for this run (a reindex's build):
        no document has points this run did not write, so none has stale chunks to find."""
        self._created_collection = True

    def plan_documents(self, source: str) -> dict[str, DocState]:
        """Read the index state of the source named ``source`` and record it as planned.

        :meth:`plan_source` does this for file sources; a caller that feeds
        documents without files (``quarry eval``) calls it directly, then writes
        the documents that are not current with :meth:`write_batch`.
        """
        state = self.store.index_state(source)
        self._planned_sources.add(source)
        self._planned_documents.update(state)
        for doc_id, doc in state.items():
            self._known_indexes[doc_id] = doc.indexes  # replaced, never changed in place
        return state

    def unchanged_file(
        self,
        plan: SourcePlan,
        uri: str,
        path: str | Path,
        *,
        max_file_bytes: int | None = None,
    ) -> bool:
        """True when the file at ``uri`` need not be read: its stamp (mtime, size) is the
        one every one of its indexed documents was loaded with, and they are complete.

        Never for a file that loading would report (over ``max_file_bytes``, or one this
        process may not read any more): a chmod keeps the mtime, a lowered limit the size."""
        if not self.trust_file_stamps:
            return False
        docs = plan.files.get(uri)
        if not docs:
            return False
        try:
            stat = os.stat(path)
        except OSError:
            return False  # loading it reports the problem
        if max_file_bytes is not None and stat.st_size > max_file_bytes:
            return False
        if not os.access(path, os.R_OK):
            return False
        mtime = file_mtime(stat)
        for doc in docs:
            if len(doc.stamps) != 1 or len(doc.hashes) != 1:
                return False
            (stamp,) = doc.stamps
            if stamp is None or not stamp.vouches_for(
                mtime, stat.st_size, LOADER_VERSION, plan.spec.encoding or ""
            ):
                return False
            if stamp.parts != len(docs):  # a document of the file is missing: read it again
                return False
            if not self.document_is_current(doc, next(iter(doc.hashes))):
                return False
        return True

    def is_current(self, plan: SourcePlan, document: Document) -> bool:
        """True when ``document`` is indexed as it is now, so it needs no embedding."""
        return self.document_is_current(plan.state.get(document.doc_id), document.doc_hash)

    def refresh_stamp(self, plan: SourcePlan, document: Document) -> None:
        """Store the file stamp a current document was just read with, when its points
        carry another (a file touched, copied or checked out again, its text the same):
        the next sync then trusts the stamp and does not read the file again. Written a
        batch at a time (:meth:`flush_stamps`)."""
        state = plan.state.get(document.doc_id)
        stamp = FileStamp.from_metadata(document.metadata)
        if state is None or stamp is None:
            return
        if any(
            stored is not None
            and stored.parts == stamp.parts
            and stored.vouches_for(stamp.mtime, stamp.size, stamp.loader, stamp.decoder)
            for stored in state.stamps
        ):
            return  # what is stored already vouches for the file (a --reread, say)
        ids = [point_id(document.doc_id, index) for index in sorted(state.indexes)]
        metadata = stamp.to_metadata()
        if not stamp.decoder and any(stored and stored.decoder for stored in state.stamps):
            metadata["decoder"] = ""  # the source no longer declares one: overwrite it
        self._stamps_due.append((state, stamp, ids, metadata, document.uri))
        self._stamp_points_due += len(ids)
        if len(self._stamps_due) >= STAMP_BATCH or self._stamp_points_due >= STAMP_BATCH_POINTS:
            self.flush_stamps()

    def flush_stamps(self) -> None:
        """Write the stamps :meth:`refresh_stamp` gathered, STAMP_BATCH documents a request
        (one a document made touching every file of a big corpus cost a request a file).
        A stamp not written only costs a read of its file next time."""
        due, self._stamps_due = self._stamps_due, []
        self._stamp_points_due = 0
        if not due or self._stopping.is_set():
            return
        try:
            self._write_stamps(due)
            return
        except WriteFailed as error:
            if len(due) == 1:
                logger.warning("could not record the new file stamp of %s: %s", due[0][4], error)
                return
        for one in due:  # one document's trouble costs only its own stamp
            try:
                self._write_stamps([one])
            except WriteFailed as error:
                logger.warning("could not record the new file stamp of %s: %s", one[4], error)

    def _write_stamps(
        self, due: Sequence[tuple[DocState, FileStamp, list[str], dict[str, Any], str]]
    ) -> None:
        self.store.update_points_metadata([(ids, metadata) for _, _, ids, metadata, _ in due])
        for state, stamp, *_ in due:
            state.stamps = {stamp}

    def document_is_current(self, state: DocState | None, doc_hash: str) -> bool:
        """True when ``state`` is one complete write of ``doc_hash`` with today's settings
        (chunking and embedded headings)."""
        if state is None or not state.is_current(doc_hash):
            return False
        return all(
            key == self.chunking_key or (key is None and self._unkeyed_current)
            for key in state.chunkings
        )

    # -- during: embed and write ---------------------------------------------------------

    def stop(self) -> None:
        """Let no batch write from now on: the run is ending (Ctrl-C, a failure) and its
        caller is about to close the clients (and release the writers' lock).

        Returns once no write is under way, so none lands after the lock is released.
        Batches still embedding return at once without writing (their requests are
        cancelled here, those in flight abandoned); a rerun does their work.
        """
        self._stopping.set()
        self.embedder.cancel_pending()
        with self._writing:
            # Bounded: a write stuck on a store that does not answer holds no one for ever.
            self._writing.wait_for(lambda: self._writes_under_way <= 0, WIND_DOWN_SECONDS)

    def write_batch(self, documents: Sequence[Document]) -> BatchResult:
        """Chunk, embed and write ``documents``; a bad document fails alone."""
        result = BatchResult()
        chunked: list[tuple[Document, list[Chunk]]] = []
        if self._stopping.is_set():
            return result
        for document in documents:
            try:
                chunks = self.chunker.chunk(document)
            except (QuarryError, ValueError) as error:
                result.failures.append(Failure(document.uri, f"chunking failed: {error}"))
                continue
            chunked.append((document, chunks))
        written = self.write_chunked(chunked)
        written.failures[:0] = result.failures
        return written

    def write_chunked(
        self,
        chunked: Sequence[tuple[Document, list[Chunk]]],
        chunkings: Mapping[str, str | None] | None = None,
    ) -> BatchResult:
        """Embed and write documents already split into chunks (a reindex starts here).

        ``chunkings`` gives, per document id, the chunk settings key to record
        instead of this chunker's (None: none, as points written before keys were):
        a reindex re-embeds stored chunks that other settings may have made.
        """
        result = BatchResult()
        if self._stopping.is_set():
            return result
        long = [(d, c) for d, c in chunked if len(c) > LONG_DOCUMENT_CHUNKS]
        if long:
            for document, chunks in long:
                self._write_long(document, chunks, self._chunking_of(document, chunkings), result)
            chunked = [(d, c) for d, c in chunked if len(c) <= LONG_DOCUMENT_CHUNKS]
            if not chunked:
                return result
        stored = self._stored_vectors(chunked)
        inputs = [[self._embedding_text(chunk) for chunk in chunks] for _, chunks in chunked]
        kept = [[stored.parts_of(text) for text in embedding_texts] for embedding_texts in inputs]
        texts: list[str] = []
        owners: list[str] = []
        for (document, _), embedding_texts, found in zip(chunked, inputs, kept, strict=True):
            for text, parts in zip(embedding_texts, found, strict=True):
                if parts is None:
                    texts.append(text)
                    owners.append(document.uri)
        if self._stopping.is_set():
            return result
        if texts:
            self.verify_canary()
        try:
            embedded = iter(self._embed(texts, owners))
        except Exception:  # CancelledError among them
            if self._stopping.is_set():  # cancelled by stop(), or a client closed since
                return result
            raise
        if texts and not self._stopping.is_set():
            try:
                self.judge_after_interruption()
            except Exception:
                if self._stopping.is_set():  # stopped meanwhile: the run says why
                    return result
                raise

        written: list[DocumentPoints] = []
        for (document, chunks), found in zip(chunked, kept, strict=True):
            outcomes: list[EmbedResult] = []
            tokens = reused = 0
            for chunk, parts in zip(chunks, found, strict=True):
                if parts is None:
                    outcomes.append(next(embedded))
                    tokens += chunk.token_count
                else:
                    outcomes.append(parts)
                    reused += len(parts)
            failure = next((o for o in outcomes if isinstance(o, EmbedFailure)), None)
            if failure is not None:
                result.failures.append(Failure(document.uri, str(failure.error)))
                continue
            chunking = self._chunking_of(document, chunkings)
            doc_points = self._points(document, chunks, outcomes, chunking)  # type: ignore[arg-type]
            doc_points.reused = reused
            written.append(doc_points)
            result.tokens_embedded += tokens

        with self._write_slot() as open_:
            if not open_:
                return result
            failed_writes = self._upsert(written)
            for doc_points in written:
                document, count, reused = doc_points.document, len(doc_points), doc_points.reused
                if document.doc_id in failed_writes:
                    result.failures.append(Failure(document.uri, failed_writes[document.doc_id]))
                    continue
                if self._stopping.is_set():
                    # Its stale chunks stay: the document reads as incomplete, and the
                    # next sync mends it.
                    continue
                self._finish_document(document, count, reused, result)
        return result

    def _chunking_of(
        self, document: Document, chunkings: Mapping[str, str | None] | None
    ) -> str | None:
        if chunkings is None:
            return self.chunking_key
        return chunkings.get(document.doc_id, self.chunking_key)

    def _finish_document(
        self, document: Document, count: int, reused: int, result: BatchResult
    ) -> None:
        """After a document's ``count`` points are written: delete the chunks a longer
        version left, and count the document in ``result``."""
        try:
            self._delete_stale_chunks(document, count)
        except StoreUnavailable:
            raise
        except QuarryError as error:
            result.failures.append(Failure(document.uri, f"cleaning old chunks: {error}"))
            return
        before = self._planned_documents.get(document.doc_id)
        if before is not None:
            result.chunks_deleted += sum(1 for index in before.indexes if index >= count)
        else:
            result.documents_added += 1
        result.documents_embedded += 1
        result.chunks_embedded += count - reused
        result.chunks_reused += reused

    @property
    def chunks_under_way(self) -> int:
        """Chunks embedded and written of long documents still being written: they are
        in no batch's result yet, and a progress line that waited for one would stand
        still for the whole of a big file."""
        return self._chunks_under_way

    def _count_under_way(self, chunks: int) -> None:
        with self._under_way_lock:
            self._chunks_under_way += chunks

    def _write_long(
        self, document: Document, chunks: list[Chunk], chunking: str | None, result: BatchResult
    ) -> None:
        counted: list[int] = []
        try:
            self._write_long_windows(document, chunks, chunking, result, counted)
        finally:  # the batch's result counts them now, or they were not finished
            self._count_under_way(-sum(counted))

    def _write_long_windows(
        self,
        document: Document,
        chunks: list[Chunk],
        chunking: str | None,
        result: BatchResult,
        counted: list[int],
    ) -> None:
        """Embed and write a document of many chunks a window at a time.

        Holding every chunk's vector until the last was embedded made one 200 MB file
        take gigabytes; written as they come, one window's vectors are the most held,
        and a run killed half way leaves the first half for the next to reuse. Points
        carry the number of chunks as ``chunk_count``, so until the last window is
        written the document reads as incomplete, and the next sync writes it again.
        Once the service has split a chunk in parts that number is no longer the
        points', and written windows could add up to it: from that window on points
        carry CHUNK_COUNT_PENDING, and all of them get the real count at the end.
        A chunk the service rejects fails the document, its earlier windows written
        (the old version's later chunks stay beside them until the next sync).
        """
        reusable = self._reusable_chunks(document)
        # An edit that inserts chunks moves the old ones to later indexes: a window
        # overwrites points whose vectors later windows want, so those are read first.
        wanted_later: dict[str, list[int]] = collections.defaultdict(list)
        if reusable:
            for position, chunk in enumerate(chunks):
                old = reusable.get(_digest(self._embedding_text(chunk)))
                if old is not None:
                    wanted_later[old].append(position)
        rescued: dict[str, Vector] = {}
        written = reused = 0
        split = False
        for start in range(0, len(chunks), LONG_DOCUMENT_WINDOW):
            if self._stopping.is_set():
                return
            window = chunks[start : start + LONG_DOCUMENT_WINDOW]
            texts = [self._embedding_text(chunk) for chunk in window]
            stored = {text: rescued.pop(text) for text in texts if text in rescued}
            stored.update(self._read_reusable([t for t in texts if t not in stored], reusable))
            missing = [text for text in texts if text not in stored]
            if missing:
                self.verify_canary()
            try:
                embedded = iter(self._embed(missing, [document.uri] * len(missing)))
                if missing and not self._stopping.is_set():
                    self.judge_after_interruption()
            except Exception:  # CancelledError among them
                if self._stopping.is_set():  # cancelled by stop(): the run says why
                    return
                raise
            outcomes: list[list[EmbeddedPart]] = []
            tokens = window_reused = 0
            for chunk, text in zip(window, texts, strict=True):
                vector = stored.get(text)
                if vector is not None:
                    outcomes.append([EmbeddedPart(text, vector)])
                    window_reused += 1
                    continue
                outcome = next(embedded)
                if isinstance(outcome, EmbedFailure):
                    kept = f" (its first {written} chunks were written)" if written else ""
                    result.failures.append(Failure(document.uri, f"{outcome.error}{kept}"))
                    return
                outcomes.append(outcome)
                tokens += chunk.token_count
            split = split or any(len(parts) > 1 for parts in outcomes)
            count = CHUNK_COUNT_PENDING if split else len(chunks)
            doc_points = self._points(
                document, window, outcomes, chunking, first_index=written, chunk_count=count
            )
            end = start + len(window)
            later = {
                self._embedding_text(chunks[position])
                for index in range(written, written + len(doc_points))
                for position in wanted_later.get(point_id(document.doc_id, index), ())
                if position >= end
            }
            rescued.update(self._read_reusable(sorted(later - rescued.keys()), reusable))
            with self._write_slot() as open_:
                if not open_:
                    return
                failed = self._upsert([doc_points])
            result.tokens_embedded += tokens
            if failed:
                result.failures.append(Failure(document.uri, failed[document.doc_id]))
                return
            written += len(doc_points)
            reused += window_reused
            counted.append(len(doc_points) - window_reused)
            self._count_under_way(counted[-1])
        with self._write_slot() as open_:
            if not open_:
                return
            if split:
                ids = [point_id(document.doc_id, index) for index in range(written)]
                try:
                    self.store.set_payload_fields(ids, {"chunk_count": written})
                except StoreUnavailable:
                    raise
                except QuarryError as error:
                    result.failures.append(Failure(document.uri, f"write failed: {error}"))
                    return
            if self._stopping.is_set():  # as write_chunked: stale chunks wait for the next sync
                return
            self._finish_document(document, written, reused, result)

    def _reusable_chunks(self, document: Document) -> dict[bytes, str]:
        """The stored whole chunks of ``document`` whose vectors could be reused, as the
        digest of the text they embed -> point id (read without their vectors).

        For a long document: its vectors are read a window at a time
        (:meth:`_read_reusable`), not all at once as :meth:`_stored_vectors` does.
        """
        state = self._planned_documents.get(document.doc_id)
        if state is None:
            return {}
        assert self.fingerprint is not None, "prepare() must run first"
        ids = [point_id(document.doc_id, index) for index in sorted(state.indexes)]
        found: dict[bytes, tuple[str, int]] = {}
        split_at: set[int] = set()
        try:
            for start in range(0, len(ids), REUSE_READ_PAGE):
                for record in self.store.retrieve(
                    ids[start : start + REUSE_READ_PAGE], _REUSE_FIELDS
                ):
                    payload = record.payload or {}
                    if payload.get("token_count") is None:
                        split_at.add(int(payload.get("char_start") or 0))
                        continue
                    text = self._reusable_text(payload)
                    if text is not None:
                        found.setdefault(
                            _digest(text), (str(record.id), int(payload.get("char_start") or 0))
                        )
        except Exception as error:  # an optimisation: without it, everything is embedded
            logger.warning("could not read stored chunks to reuse (%s); embedding all", error)
            return {}
        return {digest: id_ for digest, (id_, at) in found.items() if at not in split_at}

    def _read_reusable(
        self, texts: Sequence[str], reusable: Mapping[bytes, str]
    ) -> dict[str, Vector]:
        """The stored vectors of ``texts`` found in ``reusable``, by text.

        Read again with their payloads: this run may have written another chunk at
        that point since (an edit shifts chunks), and then its vector is not the text's.
        """
        wanted: dict[str, str] = {}
        for text in texts:
            id_ = reusable.get(_digest(text))
            if id_ is not None:
                wanted[id_] = text
        if not wanted:
            return {}
        try:
            records = self.store.retrieve(list(wanted), _REUSE_FIELDS, with_vectors=True)
        except Exception as error:
            logger.warning("could not read stored vectors to reuse (%s); embedding them", error)
            return {}
        vectors: dict[str, Vector] = {}
        for record in records:
            wanted_text = wanted.get(str(record.id))
            payload = record.payload or {}
            vector = record.vector
            if (
                wanted_text is not None
                and payload.get("token_count") is not None
                and self._reusable_text(payload) == wanted_text
                and isinstance(vector, list)
                and vector
                and isinstance(vector[0], float)  # not a multivector
            ):
                vectors[wanted_text] = np.asarray(vector, dtype=np.float32)  # an 8th of a list
        return vectors

    def _reusable_text(self, payload: Mapping[str, Any]) -> str | None:
        """The text a stored point's vector was made from, if this model made it and
        its chunk settings say how (None otherwise)."""
        assert self.fingerprint is not None, "prepare() must run first"
        with_headings = self._headings_by_key.get(payload.get("chunking"))
        text = payload.get("text")
        if (
            with_headings is None
            # Made by this model: a collection without quarry's fingerprint says nothing.
            or payload.get("model_key") != self.fingerprint.model_key
            or not isinstance(text, str)
        ):
            return None
        return embedding_text(text, payload.get("headings") or [], with_headings)

    def _stored_vectors(self, chunked: Sequence[tuple[Document, list[Chunk]]]) -> StoredVectors:
        """The vectors this collection holds for these documents, by the text they embed.

        A document written again (edited, or made with other chunk settings) mostly
        repeats chunks it had: same model, same text, same vector, so those are not
        sent to the service again. Read by point id from what the plan found; whole
        chunks made with known settings count, and so do the parts of a chunk the
        model found too long, when every part is there (a point whose embedded text
        cannot be told, or a part written before parts were marked, does not).
        """
        ids: list[str] = []
        for document, _ in chunked:
            state = self._planned_documents.get(document.doc_id)
            if state is not None:
                ids.extend(point_id(document.doc_id, index) for index in sorted(state.indexes))
        if not ids:
            return StoredVectors()
        assert self.fingerprint is not None, "prepare() must run first"
        records: list[models.Record] = []
        try:
            for start in range(0, len(ids), REUSE_READ_PAGE):
                page = ids[start : start + REUSE_READ_PAGE]
                records += self.store.retrieve(page, _REUSE_FIELDS, with_vectors=True)
        except Exception as error:  # an optimisation: without it, everything is embedded
            logger.warning("could not read stored vectors to reuse (%s); embedding all", error)
            return StoredVectors()
        # The parts of a chunk the service split have no token_count; before that held
        # for every part, the last could look whole (all of the chunk's text, the parts
        # before it only its headings) and holds the vector of a part: it starts where they do.
        split_at = {
            (payload.get("doc_id"), payload.get("char_start"))
            for payload in (record.payload or {} for record in records)
            if payload.get("token_count") is None
        }
        found = StoredVectors()
        for record in records:
            payload = record.payload or {}
            vector = record.vector
            if (
                self._headings_by_key.get(payload.get("chunking")) is None
                # Made by this model: a collection without quarry's fingerprint says nothing.
                or payload.get("model_key") != self.fingerprint.model_key
                or not isinstance(vector, list)
                or not (vector and isinstance(vector[0], float))  # not a multivector
            ):
                continue
            found.add_part(payload, vector)
            if (
                payload.get("token_count") is None
                or (payload.get("doc_id"), payload.get("char_start")) in split_at
            ):
                continue
            text = self._reusable_text(payload)
            if text is not None:
                found.whole[text] = vector
        return found

    @contextmanager
    def _write_slot(self) -> Iterator[bool]:
        """A batch's writes (upserts, then deletes of stale chunks), which stop() waits
        out; False, and nothing held, once the run is stopping."""
        held = False
        try:
            with self._writing:
                if self._stopping.is_set():
                    yield False
                    return
                held = True  # first: a signal between the two costs a count, not a hang
                self._writes_under_way += 1
            yield True
        finally:
            if held:
                with self._writing:
                    self._writes_under_way -= 1
                    self._writing.notify_all()

    def _delete_stale_chunks(self, document: Document, count: int) -> None:
        """Delete the points a longer version of ``document`` left from chunk ``count`` on.

        By point id where this run knows the document's chunk indexes: its plan read
        them (points left by earlier, even killed, runs were there then, and the
        one-writer lock keeps others out), or this run created the collection or wrote
        the document. Otherwise by a filter on the document, which in local mode scans
        the whole collection: once per changed document, that made an edit of 100
        files in a 55,000-point collection take a minute, and a reindex quadratic.
        """
        doc_id = document.doc_id
        known = self._known_indexes.get(doc_id)
        if known is None and (
            self._created_collection or document.uri.split("/", 1)[0] in self._planned_sources
        ):
            known = set()  # no points when the plan (or the collection) began
        if known is None:
            self.store.delete_stale_chunks(doc_id, count)
        else:
            stale = sorted(index for index in known if index >= count)
            if stale:
                self.store.delete_points([point_id(doc_id, index) for index in stale])
        self._known_indexes[doc_id] = set(range(count))

    def _embedding_text(self, chunk: Chunk) -> str:
        return self.embedding_text_for(chunk.text, chunk.headings)

    def embedding_text_for(self, text: str, headings: Sequence[str]) -> str:
        """The text that is embedded for a chunk (headings prepended when configured)."""
        return embedding_text(text, headings, self.embed_headings)

    def _points(
        self,
        document: Document,
        chunks: Sequence[Chunk],
        outcomes: Sequence[list[EmbeddedPart]],
        chunking: str | None,
        *,
        first_index: int = 0,
        chunk_count: int | None = None,
    ) -> DocumentPoints:
        """The points of ``chunks`` (the whole document, unless ``first_index`` says
        where they start and ``chunk_count`` how many the document has)."""
        assert self.fingerprint is not None, "prepare() must run first"
        pieces: list[_Piece] = []
        for chunk, parts in zip(chunks, outcomes, strict=True):
            if len(parts) == 1:
                pieces.append(
                    (chunk, chunk.text, chunk.char_start, chunk.char_end, parts[0].vector, None)
                )
                continue
            embedded = self._embedding_text(chunk)
            prefix = len(embedded) - len(chunk.text)
            of = split_key(embedded)
            offset = 0
            for number, part in enumerate(parts):
                start = max(offset - prefix, 0)
                end = max(offset + len(part.text) - prefix, 0)
                offset += len(part.text)
                pieces.append(
                    (
                        chunk,
                        chunk.text[start:end],
                        chunk.char_start + start,
                        chunk.char_start + end,
                        part.vector,
                        {"split_of": of, "part_index": number, "part_chars": len(part.text)},
                    )
                )
        # model_key hashes JSON each time it is read: once for the document.
        return DocumentPoints(
            document,
            pieces,
            chunking,
            self.fingerprint.model_key,
            datetime.now(UTC).isoformat(),
            first_index=first_index,
            chunk_count=len(pieces) if chunk_count is None else chunk_count,
        )

    def _upsert(self, written: Sequence[DocumentPoints]) -> dict[str, str]:
        """Upsert in batches; on a failed batch retry per document to isolate it.

        Points are made a batch at a time as they are written, so a document of a
        hundred thousand chunks never has them all as points at once.
        A failure that is Qdrant's own (StoreUnavailable: unreachable, disk full) is
        raised, not charged to the documents: the run stops, and what it could not
        write is written by the next run.
        """
        try:
            for batch in _batched(
                itertools.chain.from_iterable(doc.points() for doc in written), UPSERT_BATCH
            ):
                self.store.upsert(batch)
            return {}
        except StoreUnavailable:
            raise
        except QuarryError:
            pass
        failed: dict[str, str] = {}
        for doc_points in written:
            try:
                for batch in _batched(doc_points.points(), UPSERT_BATCH):
                    self.store.upsert(batch)
            except StoreUnavailable:
                raise
            except QuarryError as error:
                failed[doc_points.document.doc_id] = f"write failed: {error}"
        return failed

    # -- after: deletes --------------------------------------------------------------------

    def clean_source(
        self,
        plan: SourcePlan,
        seen: set[str],
        failed_uris: set[str],
        *,
        allow_mass_delete: bool,
        full_sync: bool = True,
    ) -> tuple[int, int]:
        """Delete documents gone from a synced source; returns (documents, points).

        A file that failed to load is not gone, nor is anything under a folder
        that could not be listed: their documents are kept. Without ``full_sync``,
        only documents gone from files still there are (a file emptied, a PDF that
        lost pages): a file no longer listed keeps its documents.
        """
        folders = tuple(uri for uri in failed_uris if uri.endswith("/"))
        listed = set()
        if not full_sync and plan.listing is not None:
            listed = plan.listing.still_there()[0]
        gone = [
            state
            for doc_id, state in plan.state.items()
            if doc_id not in seen
            and _file_uri(state.uri) not in failed_uris
            and not _file_uri(state.uri).startswith(folders)
            and (full_sync or _file_uri(state.uri) in listed)
        ]
        self._guard_deletes(plan.spec, len(gone), len(plan.state), allow_mass_delete)
        self.store.delete_documents([state.doc_id for state in gone])
        return len(gone), sum(state.points for state in gone)

    def _guard_deletes(
        self,
        spec: SourceSpec,
        deleting: int,
        existing: int,
        allow_mass_delete: bool,
        *,
        unit: str = "documents",
        outcome: Callable[[], str] | None = None,
    ) -> None:
        """Raise MassDeleteRefused when ``deleting`` of ``existing`` is over the fraction
        allowed; ``outcome`` says what was left undone (called only then)."""
        # A one-file source names the file: its documents going is what was asked for.
        if allow_mass_delete or existing == 0 or deleting == 0 or spec.file is not None:
            return
        fraction = deleting / existing
        if fraction > self.max_delete_fraction:
            raise MassDeleteRefused(
                f"syncing {spec.path} would delete {deleting} of the {existing} {unit} "
                f"indexed from {_scope(spec)} ({fraction:.0%} > "
                f"QUARRY_MAX_DELETE_FRACTION={self.max_delete_fraction:.0%}). Is the path "
                "mounted and the glob right? Rerun with --allow-mass-delete (a deployment: "
                f"-p allow_mass_delete=true) if this is intended.{outcome() if outcome else ''}"
            )

    def finish(self, report: IngestReport) -> None:
        """Record run-wide facts: request count, and the chunking settings now in force."""
        report.embedding_requests = self.embedder.requests_sent - self._requests_at_start
        # Syncs of one file or one source re-chunk part of the collection each: the new
        # settings become the collection's once every point was made with them.
        if (
            self.rechunk_all
            and report.documents_failed == 0  # a failed document keeps its old chunks
            and all(
                state.chunkings == {self.chunking_key}
                for state in self.store.index_state().values()
            )
        ):
            self.store.update_metadata({META_CHUNKING: dict(self.settings)})


# One point to be: (chunk, its text, char_start, char_end, vector, what marks it as a
# part of a chunk the service split; None: the whole chunk).
_Piece = tuple[Chunk, str, int, int, Vector, dict[str, Any] | None]


@dataclass(slots=True)
class DocumentPoints:
    """One document's points to write, kept as compact pieces until :meth:`points`."""

    document: Document
    pieces: list[_Piece]
    chunking: str | None
    model_key: str
    ingested_at: str
    # Where these points start among the document's, and how many it has (a long
    # document is written a window at a time).
    first_index: int = 0
    chunk_count: int = 0
    reused: int = 0

    def __len__(self) -> int:
        return len(self.pieces)

    def points(self) -> Iterator[models.PointStruct]:
        """The document's points, in chunk order, made as they are asked for."""
        document = self.document
        total = self.chunk_count
        source = document.uri.split("/", 1)[0]
        prefixes = path_prefixes(document.uri)
        pieces = enumerate(self.pieces, start=self.first_index)
        for index, (chunk, text, char_start, char_end, vector, mark) in pieces:
            payload: dict[str, Any] = {
                "doc_id": document.doc_id,
                "uri": document.uri,
                "source": source,
                "path_prefixes": list(prefixes),
                "title": document.title,
                "chunk_index": index,
                "chunk_count": total,
                "doc_hash": document.doc_hash,
                "text": text,
                "headings": list(chunk.headings),
                # A part of a split chunk has none, even one with all of its text (the
                # headings prefix went to the part before): its vector is not the chunk's.
                "token_count": None if mark else chunk.token_count,
                "char_start": char_start,
                "char_end": char_end,
                "model_key": self.model_key,
                "ingested_at": self.ingested_at,
                "metadata": dict(document.metadata),
            }
            if self.chunking is not None:
                payload["chunking"] = self.chunking
            if mark:
                payload.update(mark)
            # Built unvalidated: the id is a uuid string and the vector a list of floats by
            # construction, and pydantic checking each float cost 10% of an ingest's CPU.
            yield models.PointStruct.model_construct(
                id=point_id(document.doc_id, index),
                vector=vector if isinstance(vector, list) else vector.tolist(),
                payload=payload,
            )


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _batched(items: Iterable[models.PointStruct], size: int) -> Iterator[list[models.PointStruct]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def split_key(embedded: str) -> str:
    """What the parts of a chunk the model found too long record of its embedded text.

    A later write of the same text (same model: the same split, the same vectors)
    takes their vectors instead of sending it again.
    """
    return hashlib.sha256(embedded.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class StoredVectors:
    """Vectors a collection holds for the documents of a batch, by the text they embed."""

    whole: dict[str, list[float]] = field(default_factory=dict)
    # split_key(embedded text) -> part number -> (the part's characters, its vector)
    split: dict[str, dict[int, tuple[int, list[float]]]] = field(default_factory=dict)

    def add_part(self, payload: Mapping[str, Any], vector: list[float]) -> None:
        """Keep a point's vector if it is a marked part of a split chunk."""
        of, number, chars = (payload.get(k) for k in ("split_of", "part_index", "part_chars"))
        if isinstance(of, str) and type(number) is int and type(chars) is int and chars >= 0:
            self.split.setdefault(of, {}).setdefault(number, (chars, vector))

    def parts_of(self, embedded: str) -> list[EmbeddedPart] | None:
        """The stored vectors of this text: one, or one per part; None if not all are there."""
        vector = self.whole.get(embedded)
        if vector is not None:
            return [EmbeddedPart(embedded, vector)]
        if not self.split:
            return None
        parts = self.split.get(split_key(embedded))
        if not parts or sorted(parts) != list(range(len(parts))):
            return None
        out: list[EmbeddedPart] = []
        at = 0
        for number in range(len(parts)):
            chars, part_vector = parts[number]
            out.append(EmbeddedPart(embedded[at : at + chars], part_vector))
            at += chars
        # Every part, and nothing but them: their lengths add up to the text's.
        return out if at == len(embedded) and len(out) > 1 else None


def embedding_text(text: str, headings: Sequence[str], with_headings: bool) -> str:
    """The text embedded for a chunk: its heading breadcrumb first when ``with_headings``."""
    if with_headings and headings:
        return " > ".join(headings) + "\n\n" + text
    return text


def headings_by_key(recorded: Mapping[str, Any] | None) -> dict[str | None, bool]:
    """Whether the points of each settings key (a point's ``chunking``) were embedded
    with their headings, as far as the collection's recorded settings tell.

    The keys of the recorded chunker settings with headings on and off, and ``None``
    for points that record no key (made by the recorded settings). A key missing here
    was made by other chunk settings: what its vectors were made from is unknown.
    """
    if recorded is None:
        return {None: False}
    recorded_on = bool(recorded.get("embed_headings", False))
    known = {
        chunking_key(index_settings(recorded, True)): True,
        chunking_key(index_settings(recorded, False)): False,
        None: recorded_on,
    }
    known.setdefault(chunking_key(recorded), recorded_on)
    return known


def index_settings(chunking: Mapping[str, Any], embed_headings: bool) -> dict[str, Any]:
    """The settings that decide a document's points: ``chunking`` (a chunker's settings,
    or recorded ones) with ``embed_headings`` set as given.

    The field is there only when headings are embedded, so the default's settings, and
    so its key, are the chunker's alone, as recorded before headings were keyed: an index
    built then with headings off is current as it is.
    """
    settings = {k: v for k, v in chunking.items() if k != "embed_headings"}
    if embed_headings:
        settings["embed_headings"] = True
    return settings


def chunking_key(settings: Mapping[str, Any]) -> str:
    """A short, stable name for index settings (:func:`index_settings`), recorded in each
    point's ``chunking``."""
    blob = json.dumps(dict(settings), sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``key: old -> new`` for each setting that differs (``embed_headings`` absent: off)."""

    def value(settings: Mapping[str, Any], key: str) -> Any:
        return settings.get(key, False if key == "embed_headings" else None)

    return ", ".join(
        f"{key}: {value(old, key)} -> {value(new, key)}"
        for key in sorted({*old, *new})
        if value(old, key) != value(new, key)
    )


def path_prefixes(uri: str) -> list[str]:
    """Every folder prefix of a uri (``a/``, ``a/b/``), indexed so queries can filter by
    folder; and for a page of a PDF (``a/r.pdf#page=2``) its file (``a/r.pdf``), so a
    filter naming the file finds every page."""
    parts = uri.split("/")[:-1]
    prefixes = ["/".join(parts[: i + 1]) + "/" for i in range(len(parts))]
    file = _file_uri(uri)
    return [*prefixes, file] if file != uri else prefixes


_PAGE_SUFFIX = re.compile(r"#page=\d+\Z")


def as_indexed(store: VectorStore, spec: SourceSpec) -> SourceSpec:
    """A source inside a folder that was indexed, as a part of that folder's source.

    A file or folder synced alone is a source named after its own folder: ``quarry
    ingest docs/sub/a.md`` writes ``sub/a.md``, ``quarry ingest docs/sub`` writes
    ``sub/...``. Had ``docs/`` been ingested whole, those files are indexed as
    ``docs/sub/...`` already, or (new ones) will be by its next sync, and the alone
    sync would index them twice, under two names, the second copy going stale. So:

    * a file indexed under an enclosing folder's name is synced as that folder's file;
    * a new file that the enclosing folder's globs pick, and a folder given with the
      default globs or with that folder's own, are synced as that folder's file or
      part (with that folder's globs), when that folder is the one its source was
      last synced from whole: its path is recorded in the collection (META_SOURCES),
      so another folder of the same name elsewhere is not taken for it;
    * anything else is a source of its own folder, as before: a folder or file whose
      own folder was synced whole as a source, and a folder given globs of its own.
    """
    if spec.within is not None or (spec.file is not None and "/" in spec.file):
        return spec
    if not store.exists():
        return spec
    records = store.source_records()
    if spec.file is None:
        return _folder_as_indexed(records, spec)
    files: dict[str, set[str]] = {}

    def indexed(name: str, uri: str) -> bool:
        return uri in _indexed_files(store, name, files)

    path = spec.path
    if indexed(spec.name, spec.uri_prefix + spec.file):
        # A source is known by its name alone: an enclosing folder of the same name
        # that indexed this file as name/.../file makes `name/file` another file's uri
        # (docs/a.md beside docs/docs/a.md), and syncing it would replace that one.
        for folder in spec.root.parents:
            relative = path.relative_to(folder).as_posix()
            if folder.name == spec.name and indexed(folder.name, f"{folder.name}/{relative}"):
                own, nested = spec.uri_prefix + spec.file, f"{folder.name}/{relative}"
                raise ConfigError(
                    f"{path}: the source {spec.name!r} holds both {own!r} and {nested!r}, "
                    "and which of them is this file cannot be told from the name; ingest "
                    "the folder that was indexed"
                )
        return spec
    for folder in spec.root.parents:
        if not folder.name:
            break
        relative = path.relative_to(folder).as_posix()
        if indexed(folder.name, f"{folder.name}/{relative}"):
            return file_source(folder, relative, encoding=spec.encoding)
    # Not indexed anywhere yet (a new file, or a typo for a gone one): the folder that
    # indexes its neighbours takes it in if its globs pick it, as its next sync would.
    enclosing = _enclosing_record(records, spec)
    if enclosing is None:
        return spec
    folder, include, exclude = enclosing
    relative = path.relative_to(folder).as_posix()
    if SourceSpec(folder, include, exclude).includes(relative):
        return file_source(folder, relative, encoding=spec.encoding)
    return spec


def _folder_as_indexed(records: Mapping[str, Any], spec: SourceSpec) -> SourceSpec:
    """:func:`as_indexed` for a folder source."""
    enclosing = _enclosing_record(records, spec)
    if enclosing is None:
        return spec
    folder, include, exclude = enclosing
    globs = (spec.include, spec.exclude)
    if globs not in ((DEFAULT_INCLUDE, DEFAULT_EXCLUDE), (include, exclude)):
        return spec  # globs of its own: a source of its own, as asked
    within = spec.root.relative_to(folder).as_posix() + "/"
    return subfolder_source(folder, within, include, exclude, encoding=spec.encoding)


def _enclosing_record(
    records: Mapping[str, Any], spec: SourceSpec
) -> tuple[Path, tuple[str, ...], tuple[str, ...]] | None:
    """The nearest folder above ``spec``'s root that was synced whole as a source, with its
    globs; None when there is none, or when ``spec``'s own root was (it stays its source)."""
    if _recorded_at(records, spec.name, spec.root) is not None:
        return None
    for folder in spec.root.parents:
        record = _recorded_at(records, folder.name, folder)
        if record is not None:
            return folder, tuple(record["include"]), tuple(record["exclude"])
    return None


def source_record(spec: SourceSpec) -> dict[str, Any]:
    """What is recorded of a folder source synced whole (see META_SOURCES)."""
    return {"root": str(spec.root), "include": list(spec.include), "exclude": list(spec.exclude)}


def _recorded_at(records: Mapping[str, Any], name: str, folder: Path) -> dict[str, Any] | None:
    """The record of the source ``name`` if it was last synced whole from ``folder``."""
    record = records.get(name) if folder.name else None
    if not isinstance(record, Mapping) or record.get("root") != str(folder):
        return None
    globs = (record.get("include"), record.get("exclude"))
    if not all(isinstance(g, list) and all(isinstance(x, str) for x in g) for g in globs):
        return None
    return dict(record)


def _scope(spec: SourceSpec) -> str:
    """What a sync of ``spec`` may change, for messages: ``source 'kb'`` (and the part)."""
    part = f" under {spec.uri_prefix + spec.within!r}" if spec.within else ""
    return f"source {spec.name!r}{part}"


def _indexed_files(store: VectorStore, source: str, seen: dict[str, set[str]]) -> set[str]:
    """The file uris indexed for ``source``, read once per ``seen``."""
    if source not in seen:
        state = store.index_state(source) if store.exists() else {}
        seen[source] = {_file_uri(doc.uri) for doc in state.values()}
    return seen[source]


def refuse_unknown_missing_files(store: VectorStore, specs: Sequence[SourceSpec]) -> None:
    """Raise SourceNotFound for a one-file source whose file is gone and was never indexed.
    The specs are as :func:`as_indexed` resolved them.

    A named file that is gone is synced (its documents are deleted); one that is
    neither on disk nor in the index is most likely a typo. Checked for every
    source before anything is created or written.
    """
    missing = [
        spec
        for spec in specs
        if spec.file is not None and not spec.path.exists() and not spec.path.is_symlink()
    ]
    if not missing:
        return
    indexed: dict[str, set[str]] = {}
    for spec in missing:
        uri = f"{spec.uri_prefix}{spec.file}"
        if uri in _indexed_files(store, spec.name, indexed):
            continue
        path = str(spec.path)
        # A folder that was indexed is a source named after it, not a file of its parent.
        folder = Path(str(spec.file)).name
        held = len(store.index_state(folder)) if "/" not in str(spec.file) and store.exists() else 0
        if held:
            raise SourceNotFound(
                path,
                f"no such file or folder; a folder of this name was indexed (source "
                f"{folder!r}, {held} documents), and they are left as they are. Is it "
                "unmounted or moved? Ingest it where it is now.",
            )
        raise SourceNotFound(
            path,
            f"no such file or folder, and nothing was indexed from it (as {uri!r}); check the path",
        )


def _file_uri(uri: str) -> str:
    """The file part of a document uri (PDF pages are ``file.pdf#page=N``; a ``#`` in a
    file's own name is part of it)."""
    return _PAGE_SUFFIX.sub("", uri)


class _Result(Protocol):
    def result(self) -> BatchResult: ...


@dataclass(frozen=True, slots=True)
class _Done:
    value: BatchResult

    def result(self) -> BatchResult:
        return self.value


def _wind_down(
    sync: IndexSync,
    results: Sequence[_Result],
    log: logging.Logger | logging.LoggerAdapter[Any],
    grace: float = WIND_DOWN_SECONDS,
) -> None:
    """Stop the batches in flight (see :meth:`IndexSync.stop`), then give them up to
    ``grace`` seconds to return before the caller closes the clients under them (one
    that takes longer meets a closed client and returns all the same)."""
    # A Prefect future wraps a concurrent one; run_inline's results are done.
    futures = [getattr(result, "wrapped_future", result) for result in results]
    running = [f for f in futures if isinstance(f, Future) and not f.done()]
    if running:
        log.warning("stopping: %d batch(es) in flight write nothing more", len(running))
    sync.stop()
    futures_wait(running, timeout=grace)


def run_inline(sync: IndexSync, documents: list[Document]) -> _Result:
    """The default way to run a batch: here and now."""
    return _Done(sync.write_batch(documents))


# An ingest allocates a few container objects per chunk (payloads, points, pieces)
# and keeps them for a while, so CPython's default gen-0 threshold (700) ran ~70
# young collections a 2,000-chunk run, about 4% of its client CPU for nothing to
# free: reference counting frees what an ingest drops.
_YOUNG_GC_THRESHOLD = 20_000
_gc_lock = threading.Lock()
_gc_holders = 0
_gc_saved: tuple[int, int, int] = (700, 10, 10)


@contextmanager
def _young_collections_less_often() -> Iterator[None]:
    """Raise the gen-0 collection threshold while any sync runs in this process."""
    global _gc_holders, _gc_saved
    with _gc_lock:
        if _gc_holders == 0:
            _gc_saved = gc.get_threshold()
            if _gc_saved[0] and _gc_saved[0] < _YOUNG_GC_THRESHOLD:  # 0: collection is off
                gc.set_threshold(_YOUNG_GC_THRESHOLD, *_gc_saved[1:])
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and gc.get_threshold()[0] == _YOUNG_GC_THRESHOLD:
                gc.set_threshold(*_gc_saved)


@_young_collections_less_often()
def run_sync(
    sync: IndexSync,
    specs: Sequence[SourceSpec],
    *,
    full_sync: bool = True,
    allow_mass_delete: bool = False,
    max_file_bytes: int = 20 * 1024 * 1024,
    submit: Callable[[IndexSync, list[Document]], _Result] = run_inline,
    window: int = 4,
    log: logging.Logger | logging.LoggerAdapter[Any] = logger,
    load_failures: list[Failure] | None = None,
    progress: Callable[[IngestProgress], None] | None = None,
) -> IngestReport:
    """Sync every source into the collection and return the report.

    ``submit`` runs one batch of documents and returns something with
    ``result()`` (a Prefect future in the flow); at most ``window`` batches are in
    flight, so memory stays bounded whatever the corpus size. The failures of
    files that could not be loaded (a part of the report's ``failures``) are also
    appended to ``load_failures`` when given. ``progress`` is called once a
    source is walked, after each batch is written, about every second while a batch
    is awaited or files that need none are checked, and at the end.
    """
    report = IngestReport(collection=sync.store.alias)
    resolved: list[SourceSpec] = []
    for given in specs:
        spec = as_indexed(sync.store, given)
        if spec.within is not None and given.within is None:
            report.notes.append(
                f"{spec.path} is in {spec.root}, which was indexed as source {spec.name!r}: "
                f"synced as its part {spec.uri_prefix + spec.within!r}, not as a source of its own"
            )
        if spec not in resolved:  # a path given twice (kb/a and kb/a/) is synced once
            resolved.append(spec)
    specs = resolved
    refuse_overlapping_sources(specs)  # again: a part may share its folder's name with another
    specs = without_parts_taken_in(specs)  # `docs docs/a.md`: a.md synced, and counted, once
    refuse_unknown_missing_files(sync.store, specs)
    sync.prepare(report)
    for note in report.notes:
        log.info(note)
    files = _FileTally()
    told_chunks = 0
    soon = every(PROGRESS_TICK_SECONDS)

    def tell() -> None:
        nonlocal told_chunks
        if progress is not None:
            # Never backwards (a file whose later pages wait for a batch counts again;
            # a long document's chunks leave chunks_under_way before its batch is collected).
            files.done = max(files.done, files.checked - len(unwritten.keys() | held))
            told_chunks = max(told_chunks, report.chunks_embedded + sync.chunks_under_way)
            progress(
                IngestProgress(
                    files.done,
                    files.found,
                    report.documents_embedded,
                    told_chunks,
                    report.documents_failed,
                )
            )

    def tell_soon() -> None:
        if progress is not None and soon():
            tell()

    # Batches submitted and not yet collected, with the files each holds; and how many
    # of those batches hold each file (a PDF's pages may span batches).
    in_flight: deque[tuple[_Result, set[str]]] = deque()
    unwritten: collections.Counter[str] = collections.Counter()
    # The files of the documents gathered for the next batch, not yet submitted.
    held: set[str] = set()

    def holding(documents: Iterator[Document]) -> Iterator[Document]:
        for document in documents:
            held.add(_file_uri(document.uri))
            yield document

    def collect_oldest() -> None:
        future, batch_files = in_flight[0]
        # A Prefect future wraps a concurrent one; run_inline's results are done.
        waiting = getattr(future, "wrapped_future", future)
        if progress is not None and isinstance(waiting, Future):
            while not futures_wait([waiting], timeout=PROGRESS_TICK_SECONDS).done:
                tell()  # a big file's windows, files checked by other batches
        _collect(future, report, log)  # a Ctrl-C while it waits leaves it for _wind_down
        in_flight.popleft()
        for uri in batch_files:
            unwritten[uri] -= 1
            if not unwritten[uri]:
                del unwritten[uri]
        tell()

    # Mass deletes refused, each of one source: the other sources are synced all the
    # same (one source's missing mount must not hold back the rest of a nightly run),
    # and the run is refused at the end, saying what it did.
    refused: list[tuple[SourceSpec, MassDeleteRefused]] = []
    try:
        for spec in specs:
            try:
                plan = sync.plan_source(
                    spec, full_sync=full_sync, allow_mass_delete=allow_mass_delete
                )
            except MassDeleteRefused as refusal:
                refused.append((spec, refusal))
                log.warning("%s", refusal)
                continue
            files.found += len(plan.listing.found) if plan.listing is not None else 1
            tell()
            if spec.file is None and plan.listing is not None and not plan.listing.found:
                note = (
                    f"{spec.path}: no file to index (include {', '.join(spec.include)}); "
                    "check the path and --include"
                )
                report.notes.append(note)
                log.warning(note)
            seen: set[str] = set()
            failed_uris: set[str] = set()
            pending = _pending_documents(
                sync,
                plan,
                report,
                seen,
                failed_uris,
                max_file_bytes,
                log,
                load_failures,
                files,
                checked=tell_soon,
            )
            for batch in _batches(holding(pending)):
                batch_files = {_file_uri(document.uri) for document in batch}
                unwritten.update(batch_files)
                held.clear()  # _batches yields a batch as soon as its last document came
                in_flight.append((submit(sync, batch), batch_files))
                while len(in_flight) >= window:
                    collect_oldest()
            while in_flight:
                collect_oldest()
            sync.flush_stamps()
            left = _clean(sync, plan, seen, failed_uris, report, allow_mass_delete, full_sync)
            if left is not None:
                refused.append((spec, left))
                log.warning("%s", left)
    except BaseException:
        # Ctrl-C or a failure: the caller closes the clients next, under any batch
        # still running (tracebacks, and with a Qdrant server, writes after the
        # writers' lock is released).
        _wind_down(sync, [future for future, _ in in_flight], log)
        raise
    # Where each folder synced whole lives, so that a later sync of a part is known.
    left_alone = [spec for spec, _ in refused]
    sync.store.record_sources(
        {
            s.name: source_record(s)
            for s in specs
            if s.file is None and s.within is None and s not in left_alone
        }
    )
    sync.finish(report)
    # Exact at the end: a long document that failed part way had its written windows
    # counted while under way, and is not in the report's chunks.
    told_chunks = report.chunks_embedded
    tell()
    if refused:
        raise _refused_run(
            [refusal for _, refusal in refused], report, [s for s in specs if s not in left_alone]
        )
    return report


def _refused_run(
    refusals: Sequence[MassDeleteRefused], report: IngestReport, synced: Sequence[SourceSpec]
) -> MassDeleteRefused:
    """The one refusal of a run that left (part of) some of its sources alone: each
    one's reason, the sources it synced all the same, and what the run did."""
    said = " ".join(str(refusal) for refusal in refusals)
    if synced:
        names = dict.fromkeys(
            repr((spec.uri_prefix + (spec.within or spec.file or "")).rstrip("/"))
            for spec in synced
        )
        said += f" Synced all the same: {', '.join(names)}."
    done = [
        f"{count} {what}"
        for count, what in (
            (report.documents_embedded, "new or changed documents embedded and written"),
            (report.documents_deleted, "documents of files gone deleted"),
            (report.documents_failed, "documents failed"),
        )
        if count
    ]
    said += f" This run: {', '.join(done)}." if done else " This run changed nothing."
    if report.failures:
        first = report.failures[0]
        said += f" First failure: {first.uri}: {first.error}"
    return MassDeleteRefused(said)


def _clean(
    sync: IndexSync,
    plan: SourcePlan,
    seen: set[str],
    failed_uris: set[str],
    report: IngestReport,
    allow_mass_delete: bool,
    full_sync: bool,
) -> MassDeleteRefused | None:
    """Delete a source's documents that are gone, into ``report``; or return the refusal
    of a mass delete, found once the files were read (emptied ones, say): by then its
    new and changed documents were written, and they stay."""
    try:
        deleted, points = sync.clean_source(
            plan, seen, failed_uris, allow_mass_delete=allow_mass_delete, full_sync=full_sync
        )
    except MassDeleteRefused as refused:
        return MassDeleteRefused(f"{refused} Nothing was deleted from {_scope(plan.spec)}.")
    report.documents_deleted += deleted
    report.chunks_deleted += points
    return None


# Said of a file that failed to load and was indexed before: a query still finds it.
_KEPT = "; what was indexed from it before is kept (still searchable)"


def _pending_documents(
    sync: IndexSync,
    plan: SourcePlan,
    report: IngestReport,
    seen: set[str],
    failed_uris: set[str],
    max_file_bytes: int,
    log: logging.Logger | logging.LoggerAdapter[Any],
    load_failures: list[Failure] | None = None,
    files: _FileTally | None = None,
    *,
    checked: Callable[[], None] = lambda: None,
) -> Iterator[Document]:
    """Load a source's documents, recording what was seen and failed; yield the changed
    ones. ``checked`` is called after each file that needs no batch (unchanged, failed,
    current): thousands of those between two batches are progress too."""

    def unchanged(uri: str, path: str) -> bool:
        return sync.unchanged_file(plan, uri, path, max_file_bytes=max_file_bytes)

    items = iter_documents(
        plan.spec, max_file_bytes=max_file_bytes, unchanged=unchanged, listing=plan.listing
    )
    files = files if files is not None else _FileTally()
    last_file = None
    for item in items:
        file = _file_uri(item.uri)  # a PDF's pages are documents of one file
        if file != last_file:
            files.checked += 1
            last_file = file
        if isinstance(item, UnchangedFile):
            docs = plan.files[item.uri]
            report.files_unread += 1
            report.documents_seen += len(docs)
            report.documents_skipped += len(docs)
            seen.update(doc.doc_id for doc in docs)
            checked()
            continue
        if isinstance(item, LoadFailure):
            failed_uris.add(_file_uri(item.uri))  # its points stay until a sync finds it gone
            if item.vanished:
                # Deleted or moved while the run went on: a user's edit, not a bad file, so
                # not a failure (a nightly with fail_on_failures would page someone).
                log.info("%s %s", item.uri, item.error)
                report.notes.append(
                    f"{item.uri} {item.error}; the next sync removes what it had indexed"
                )
                continue
            log.warning("could not load %s: %s", item.uri, item.error)
            held = _file_uri(item.uri) in plan.files
            failure = Failure(item.uri, f"{item.error}{_KEPT if held else ''}")
            report.fail([failure])
            if load_failures is not None:
                load_failures.append(failure)
            checked()
            continue
        report.documents_seen += 1
        seen.add(item.doc_id)
        if sync.is_current(plan, item):
            report.documents_skipped += 1
            sync.refresh_stamp(plan, item)
            checked()
            continue
        yield item


def _batches(items: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for document in items:
        batch.append(document)
        size += len(document.text)
        if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_CHARACTERS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _collect(
    future: _Result, report: IngestReport, log: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    result = future.result()
    for failure in result.failures:
        log.warning("failed %s: %s", failure.uri, failure.error)
    report.add(result)
