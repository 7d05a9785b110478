"""Blue/green rebuilds: a new physical collection beside the old, then an atomic alias switch.

A reindex builds ``<alias>__<model_key>__<UTC timestamp>`` with the live
service's fingerprint, from the chunk texts already stored (default) or from
the sources, verifies it, and only then points the alias at it. Queries keep
being answered from the old collection until that instant, and the old one is
kept for :func:`rollback` until pruned.
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from qdrant_client import models

from quarry.documents import Chunk, Document
from quarry.embeddings import EmbeddedPart
from quarry.errors import CanaryMismatch, ConfigError, MassDeleteRefused, Refused, StoreError
from quarry.fingerprint import Fingerprint, cosine, query_task_changed, read_fingerprint
from quarry.ingest import (
    PROGRESS_SECONDS,
    Failure,
    IndexSync,
    IngestReport,
    StoredVectors,
    _file_uri,
    chunking_key,
    every,
    index_settings,
    run_sync,
)
from quarry.sources import SourceSpec, checked_encoding
from quarry.store import (
    INTERRUPTED_WRITE,
    META_CHUNKING,
    META_SOURCES,
    CollectionInfo,
    DocState,
    VectorStore,
)

logger = logging.getLogger(__name__)

META_PREVIOUS = "quarry_previous"
# A reindex's build says how far it got: BUILDING from its creation, so one whose
# process was killed says so in `quarry collections`; COMPLETE once switched to;
# REFUSED when the --min-ndcg gate kept it for inspection.
META_BUILD = "quarry_build"
BUILDING, COMPLETE, REFUSED = "building", "complete", "refused"
VERIFY_SAMPLE = 16
VERIFY_SPLIT_CHUNKS = 4
REINDEX_DOCUMENTS_PER_BATCH = 64


@dataclass(slots=True)
class ReindexReport:
    """What a reindex did; ``to_dict`` is the ``--json`` shape."""

    alias: str
    previous: str | None
    collection: str
    model: dict[str, Any]
    documents: int = 0
    points: int = 0
    verified_sample: int = 0
    min_sample_cosine: float | None = None
    evaluation: dict[str, Any] | None = None
    switched: bool = False
    failures: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "alias": self.alias,
            "previous": self.previous,
            "collection": self.collection,
            "model": self.model,
            "documents": self.documents,
            "points": self.points,
            "verified_sample": self.verified_sample,
            "min_sample_cosine": (
                None if self.min_sample_cosine is None else round(self.min_sample_cosine, 6)
            ),
            "evaluation": self.evaluation,
            "switched": self.switched,
            "failures": self.failures,
            "notes": self.notes,
        }


def stored_documents(
    store: VectorStore,
    batch: int = REINDEX_DOCUMENTS_PER_BATCH,
    interrupted: list[str] | None = None,
    chunkings: dict[str, str | None] | None = None,
    *,
    doc_ids: Iterable[str] | None = None,
    rekey: Mapping[str, str] | None = None,
) -> Iterator[list[tuple[Document, list[Chunk]]]]:
    """The documents in the alias's collection rebuilt from their points, in batches.

    The stored chunk texts are re-used as they are: a reindex re-embeds, it
    does not re-chunk (``--from-source`` does both). A document whose points
    disagree (several hashes or chunk counts, or a gap: an ingest was killed
    while writing it) is carried as it is, under the hash INTERRUPTED_WRITE and
    without a complete file stamp, so the next sync reads and mends it instead of
    taking it for current; its uri is appended to ``interrupted``. The chunk
    settings key each document's points carry is put in ``chunkings``, mapped by
    ``rekey`` (a key the reindex records in place of the one stored). ``doc_ids``
    spares a scan of the collection when the caller has read its state already.
    """
    ids = sorted(store.index_state() if doc_ids is None else doc_ids)
    for start in range(0, len(ids), batch):
        wanted = ids[start : start + batch]
        points = store.scroll(
            query_filter=models.Filter(
                must=[models.FieldCondition(key="doc_id", match=models.MatchAny(any=wanted))]
            )
        )
        by_doc: dict[str, list[dict[str, Any]]] = {}
        for point in points:
            payload = point.payload or {}
            by_doc.setdefault(str(payload["doc_id"]), []).append(payload)
        group: list[tuple[Document, list[Chunk]]] = []
        for doc_id in wanted:
            payloads = sorted(by_doc.get(doc_id, []), key=lambda p: int(p["chunk_index"]))
            if not payloads:
                continue
            first = payloads[0]
            if chunkings is not None:
                key = first.get("chunking")
                chunkings[doc_id] = (rekey or {}).get(key, key) if isinstance(key, str) else None
            metadata = dict(first.get("metadata") or {})
            doc_hash = str(first["doc_hash"])
            if not _consistent(payloads):
                doc_hash = INTERRUPTED_WRITE
                # Without loaded_at the stamp is incomplete and vouches for nothing.
                metadata.pop("loaded_at", None)
                if interrupted is not None:
                    interrupted.append(str(first["uri"]))
            document = Document(
                doc_id=doc_id,
                uri=str(first["uri"]),
                text="",
                title=str(first.get("title", "")),
                metadata=metadata,
                doc_hash=doc_hash,
            )
            chunks = [
                Chunk(
                    doc_id=doc_id,
                    index=int(p["chunk_index"]),
                    text=str(p["text"]),
                    token_count=int(p.get("token_count") or 0),
                    headings=tuple(p.get("headings") or ()),
                    char_start=int(p.get("char_start", 0)),
                    char_end=int(p.get("char_end", 0)),
                )
                for p in payloads
            ]
            group.append((document, chunks))
        yield group


def _consistent(payloads: Sequence[dict[str, Any]]) -> bool:
    """Whether a document's points (sorted by chunk index) are one complete write.

    One chunk settings key too: a re-chunk killed part way can leave chunks of the
    same text and count made by two settings.
    """
    hashes = {p.get("doc_hash") for p in payloads}
    counts = {p.get("chunk_count") for p in payloads}
    keys = {p.get("chunking") for p in payloads}
    indexes = [p.get("chunk_index") for p in payloads]
    return (
        len(hashes) == 1
        and len(keys) == 1
        and counts == {len(payloads)}
        and indexes == list(range(len(payloads)))
    )


def verify(target: VectorStore, sync: IndexSync, expected_points: int) -> tuple[int, float | None]:
    """Check the new collection: the point count, and a sample of vectors re-embedded.

    The sample is up to ``VERIFY_SAMPLE`` whole chunks and the parts of up to
    ``VERIFY_SPLIT_CHUNKS`` split ones: a move to a model with a shorter input limit
    splits nearly every chunk, and is when the check matters most. Returns (points
    checked, lowest cosine; None when there was nothing to check). Raises StoreError
    when it does not hold.
    """
    count = target.count()
    if count != expected_points:
        raise StoreError(
            target.alias,
            f"new collection {target.resolve()} holds {count} points, expected "
            f"{expected_points}; the alias was not switched and the collection is dropped",
        )
    whole: list[str] = []
    # By document too: a chunk repeated in two documents (a licence) has one split key.
    split: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for record in target.scroll(fields=["token_count", "split_of", "doc_id"]):
        payload = record.payload or {}
        if payload.get("token_count") is not None:
            whole.append(str(record.id))
        elif payload.get("split_of") is not None:  # parts written before marks: no way back
            key = (str(payload.get("doc_id")), str(payload["split_of"]))
            split[key].append(str(record.id))
    rng = random.Random(0)
    sample = rng.sample(whole, min(VERIFY_SAMPLE, len(whole)))
    chosen = rng.sample(sorted(split), min(VERIFY_SPLIT_CHUNKS, len(split)))
    format_passage = sync.embedder.profile.format_passage
    # (the stored vector, the text that made it, formatted as it was sent)
    checks: list[tuple[Sequence[float], str]] = []
    for record in target.retrieve(sample, ["text", "headings"], with_vectors=True):
        payload = record.payload or {}
        headings = tuple(payload.get("headings") or ())
        text = sync.embedding_text_for(str(payload.get("text", "")), headings)
        checks.append((cast("Sequence[float]", record.vector), format_passage(text)))
    part_fields = ["text", "headings", "chunk_index", "split_of", "part_index", "part_chars"]
    for key in chosen:
        records = target.retrieve(split[key], part_fields, with_vectors=True)
        for part in _stored_parts(sync, records):
            checks.append((list(part.vector), format_passage(part.text)))
    if not checks:
        return 0, None
    vectors = sync.embedder.embed_raw([text for _, text in checks])
    lowest = min(
        cosine(stored, vector) for (stored, _), vector in zip(checks, vectors, strict=True)
    )
    if lowest < 0.999:
        raise StoreError(
            target.alias,
            f"new collection {target.resolve()}: a sampled vector re-embeds with cosine "
            f"{lowest:.5f} < 0.999; the embedding service is not deterministic or changed "
            "during the reindex; the alias was not switched and the collection is dropped",
        )
    return len(checks), lowest


def _stored_parts(sync: IndexSync, records: Sequence[models.Record]) -> list[EmbeddedPart]:
    """The parts of one split chunk, each with the slice of the chunk's embedded text it
    was embedded from and its stored vector; none when they are not all there."""
    found = sorted(records, key=lambda record: int((record.payload or {}).get("chunk_index") or 0))
    # The first copy's parts, when a document holds the same chunk twice.
    later = [i for i, r in enumerate(found) if i and (r.payload or {}).get("part_index") == 0]
    parts = found[: later[0]] if later else found
    if not parts:
        return []
    stored = StoredVectors()
    for record in parts:
        stored.add_part(record.payload or {}, cast("list[float]", record.vector))
    payloads = [record.payload or {} for record in parts]
    chunk_text = "".join(str(payload.get("text", "")) for payload in payloads)
    embedded = sync.embedding_text_for(chunk_text, tuple(payloads[0].get("headings") or ()))
    return stored.parts_of(embedded) or []


def reindex(
    store: VectorStore,
    make_sync: Callable[[VectorStore], IndexSync],
    *,
    from_source: Sequence[SourceSpec] = (),
    max_file_bytes: int = 20 * 1024 * 1024,
    max_delete_fraction: float = 0.3,
    allow_mass_delete: bool = False,
    gate: Callable[[], dict[str, Any]] | None = None,
    progress: Callable[[str], None] = lambda message: None,
    force: bool = False,
    min_canary_cosine: float = 0.999,
) -> ReindexReport:
    """Rebuild the alias's collection with the live model and switch to it when it checks out.

    ``make_sync`` builds an IndexSync over a given store view. ``gate`` (an
    evaluation) runs before the switch; it raises Refused to stop it. A new
    collection that lacks more than ``max_delete_fraction`` of the documents the
    alias serves (``--from-source`` given only some of the sources, or the
    wrong globs) is not switched to unless ``allow_mass_delete``. A rebuild that
    would only copy what the alias serves (same model, serving, canary within
    ``min_canary_cosine`` and chunk settings) is refused unless ``force``.
    """
    previous = store.alias_target()
    if previous is None:
        store.refuse_a_collection_name()
    if previous is None and not from_source:
        raise StoreError(store.alias, "does not exist; nothing to reindex (use --from-source PATH)")
    # What the alias serves, read once: the collection does not change while a
    # new one is built beside it.
    served = store.index_state() if previous is not None else {}
    if from_source and previous is not None and not allow_mass_delete:
        # Documents of a source not given are lost for certain: refuse before building,
        # however small the source.
        given = {spec.name for spec in from_source}
        lost = [state for state in served.values() if _source_of(state) not in given]
        _refuse_lost(store.alias, "the sources given", lost, served, 0.0)
    probe = make_sync(store)
    live: Fingerprint = read_fingerprint(probe.embedder)
    chunking: Mapping[str, Any] = probe.settings
    rekey: dict[str, str] = {}
    if not from_source and previous is not None:
        # The stored chunks are re-embedded as they are: they keep the chunk settings
        # that made them, so a later sync with other ones still re-chunks them. Their
        # text is embedded as today's settings say (headings prepended or not), and
        # their keys are made to say so.
        recorded = store.metadata(previous).get(META_CHUNKING)
        if recorded:
            chunking = index_settings(recorded, probe.embed_headings)
        rekey = _rekey_headings([chunking, probe.settings], probe.embed_headings)
        if not force:
            _refuse_identical(store, previous, live, chunking, min_canary_cosine)
    extra: dict[str, Any] = {META_BUILD: BUILDING}
    if not from_source and previous is not None:
        # Built from the stored chunks: the same folders' documents, so the same records.
        sources = store.metadata(previous).get(META_SOURCES)
        if sources:
            extra[META_SOURCES] = sources
    physical = store.create_physical(live, chunking, extra_metadata=extra)
    target = store.view(physical)
    gate_refused = False
    try:
        try:
            report = _build(
                store,
                target,
                previous,
                served,
                make_sync,
                live,
                from_source,
                max_file_bytes,
                progress,
                rekey,
            )
        except CanaryMismatch as error:
            # The canary compared is the one this build recorded at its start.
            raise StoreError(
                store.alias,
                f"new collection {physical}: the canary text embedded differently during "
                "the reindex than at its start; the embedding service is not deterministic "
                "or changed during the reindex; the alias was not switched and the "
                "collection is dropped",
            ) from error
        if previous is not None and not allow_mass_delete:
            _guard_lost_documents(store.alias, served, target, max_delete_fraction)
        if gate is not None:
            try:
                report.evaluation = gate()
            except Refused:
                gate_refused = True
                target.update_metadata({META_BUILD: REFUSED})
                raise
        target.update_metadata({META_PREVIOUS: previous, META_BUILD: COMPLETE})
        # Read before the switch, which is the last step: a Ctrl-C after it finds a
        # reindex done, with as little as possible left to say so.
        leftovers = _unfinished_builds(store, physical)
        store.point_alias(physical)
    except BaseException as error:
        # A build that is refused or broke off is of no use: nothing switches to it,
        # and a rerun builds another. One the gate refuses (--min-ndcg) is kept for
        # inspection; an evaluation that broke off refused nothing and is dropped.
        if not gate_refused:
            _drop_build(store, physical, error)
            said = str(error)
            if isinstance(error, Exception) and not (
                "not switched" in said or "was not created" in said
            ):
                # A service that died mid-build, say: whoever reads the error wants this.
                served_now = f"; it still serves {previous}" if previous else ""
                error.add_note(
                    f"the alias {store.alias!r} was not switched{served_now}, and the "
                    "unfinished collection was dropped: run the reindex again"
                )
        raise
    report.switched = True
    progress(f"alias {store.alias} -> {physical}")
    if leftovers:  # one writer at a time: no other reindex is building them
        report.notes.append(
            f"{len(leftovers)} unfinished build(s) of earlier reindexes that were killed "
            f"are left, never served ({', '.join(leftovers)}); `quarry prune` deletes them "
            "first"
        )
    return report


def refuse_bad_parameters(
    *,
    eval_dataset: str | Path | None,
    min_ndcg: float | None,
    eval_split: str,
    from_source: bool,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    encoding: str | None,
    names: Mapping[str, str] | None = None,
) -> None:
    """ConfigError (SourceNotFound for a dataset that is not there) for reindex
    parameters that would be ignored, or found wrong only after the whole collection
    was re-embedded. ``names`` says what to call each parameter (the CLI's flags)."""

    def called(key: str) -> str:
        return (names or {}).get(key, key)

    if min_ndcg is not None and eval_dataset is None:
        raise ConfigError(f"{called('min_ndcg')} needs {called('eval_dataset')}")
    if min_ndcg is not None and not 0.0 <= min_ndcg <= 1.0:
        # NaN fails this too: it would pass every gate (nothing compares below it),
        # and above 1 refuse every build.
        raise ConfigError(f"{called('min_ndcg')} must be between 0 and 1, not {min_ndcg}")
    if eval_split != "test" and eval_dataset is None:
        raise ConfigError(f"{called('eval_split')} needs {called('eval_dataset')}")
    if (include or exclude or encoding) and not from_source:
        raise ConfigError(
            f"{called('include')}, {called('exclude')} and {called('encoding')} need "
            f"{called('from_source')}"
        )
    if encoding is not None:
        checked_encoding(encoding)
    if eval_dataset is not None:
        from quarry.evaluate import load_beir

        load_beir(str(eval_dataset), eval_split)


def _unfinished_builds(store: VectorStore, physical: str) -> list[str]:
    """The alias's builds other than ``physical`` still marked under way (their reindex
    was killed), for a note; best effort: a complete build is not dropped for it."""
    try:
        return [
            name
            for name in store.physical_names()
            if name != physical and store.metadata(name).get(META_BUILD) == BUILDING
        ]
    except Exception as error:  # a note, not a reason to lose the build
        logger.warning("could not look for unfinished builds of %s: %s", store.alias, error)
        return []


def _build(
    store: VectorStore,
    target: VectorStore,
    previous: str | None,
    served: Mapping[str, DocState],
    make_sync: Callable[[VectorStore], IndexSync],
    live: Fingerprint,
    from_source: Sequence[SourceSpec],
    max_file_bytes: int,
    progress: Callable[[str], None],
    rekey: Mapping[str, str],
) -> ReindexReport:
    """Fill ``target`` (a view of the new collection) from the sources or the stored
    chunks (their keys mapped by ``rekey``, see :func:`_rekey_headings`), and verify it.

    Raises Refused when a document failed that the new collection cannot leave
    out; the caller drops the collection on any error.
    """
    physical = target.resolve() or ""
    sync = make_sync(target)
    report = ReindexReport(
        alias=store.alias,
        previous=previous,
        collection=physical,
        model={"model_id": live.model.model_id, "model_key": live.model_key},
    )
    progress(f"building {physical} with {live.model.describe()}")
    ingest = IngestReport(collection=physical)
    interrupted: list[str] = []
    chunkings: dict[str, str | None] = {}
    unloaded: list[Failure] = []
    due = every(PROGRESS_SECONDS)
    if from_source:
        ingest = run_sync(
            sync,
            from_source,
            full_sync=True,
            max_file_bytes=max_file_bytes,
            load_failures=unloaded,
            progress=lambda state: progress(state.describe()) if due() else None,
        )
    else:
        sync.prepare(ingest)
        sync.assume_empty()  # ``target`` was created for this build
        groups = stored_documents(
            store, interrupted=interrupted, chunkings=chunkings, doc_ids=served, rekey=rekey
        )
        for group in groups:
            ingest.add(sync.write_chunked(group, chunkings))
            if due():
                progress(
                    f"re-embedded {ingest.documents_embedded:,} of {len(served):,} documents "
                    f"({ingest.chunks_embedded:,} chunks)"
                )
    progress(
        f"embedded {ingest.documents_embedded:,} documents ({ingest.chunks_embedded:,} chunks); "
        "verifying"
    )
    report.documents = ingest.documents_embedded
    report.points = ingest.chunks_embedded + ingest.chunks_reused
    report.failures = [{"uri": f.uri, "error": f.error} for f in ingest.failures]
    if interrupted:
        report.notes.append(
            f"{len(interrupted)} document(s) left half-written by an interrupted ingest "
            f"(first: {interrupted[0]}) are carried as they were; the next `quarry ingest` "
            "of their source reads them again"
        )
    skipped, blocking = _sort_failures(served, ingest.failures, unloaded)
    if blocking:
        shown = "; ".join(f"{f.uri}: {f.error}" for f in blocking[:5])
        more = f"; and {len(blocking) - 5} more" if len(blocking) > 5 else ""
        kept = (
            f"the alias was not switched: it still points at {previous}"
            if previous is not None
            else f"the alias {store.alias!r} was not created"
        )
        raise Refused(
            f"reindex into {physical}: {len(blocking)} document(s) failed that the new "
            f"collection cannot leave out ({shown}{more}); {physical} was dropped and {kept}. "
            "Fix the cause and run `quarry reindex` again."
        )
    if skipped:
        report.notes.append(
            f"{len(skipped)} file(s) that could not be read and were never indexed are left "
            f"out, as `quarry ingest` left them out (first: {skipped[0].uri}: "
            f"{skipped[0].error})"
        )
    report.verified_sample, report.min_sample_cosine = verify(target, sync, report.points)
    if report.points and not report.verified_sample:
        report.notes.append(
            "no point could be re-embedded to check the new collection (no whole chunk, and "
            "no split chunk with all its parts marked); only its point count was checked"
        )
    return report


def _rekey_headings(known: Sequence[Mapping[str, Any]], embed_headings: bool) -> dict[str, str]:
    """Point keys of the chunk settings in ``known``, with headings embedded or not, to
    the key of the same chunk settings with ``embed_headings`` as given.

    A key of other settings (a re-chunk was under way with settings since changed
    again) is not among them and is kept: its document is not current, so the next
    sync re-chunks it.
    """
    table: dict[str, str] = {}
    for settings in known:
        target = chunking_key(index_settings(settings, embed_headings))
        for headings in (False, True):
            table[chunking_key(index_settings(settings, headings))] = target
    return table


def _sort_failures(
    served: Mapping[str, DocState],
    failures: Sequence[Failure],
    unloaded: Sequence[Failure],
) -> tuple[list[Failure], list[Failure]]:
    """Split a build's failures into (left out, refusing the switch).

    Left out: a file that could not be loaded and has no documents in the
    collection the alias serves (ingest skipped it too), so the new collection
    loses nothing by lacking it. Any other failure (a served file now unreadable,
    a document the embedding service failed) would lose a document: it refuses.
    """
    if not failures:
        return [], []
    served_files = {_file_uri(state.uri) for state in served.values()}
    load_failed = set(unloaded)
    skipped: list[Failure] = []
    blocking: list[Failure] = []
    for failure in failures:
        uri = _file_uri(failure.uri)
        # A folder that could not be listed ("docs/sub/") stands for every file under it.
        lost = (
            any(s.startswith(uri) for s in served_files)
            if uri.endswith("/")
            else uri in served_files
        )
        if failure in load_failed and not lost:
            skipped.append(failure)
        else:
            blocking.append(failure)
    return skipped, blocking


def _drop_build(store: VectorStore, physical: str, error: BaseException) -> None:
    """Delete a build nothing will switch to, without hiding why it stopped."""
    try:
        store.drop(physical)
    except Exception as failed:  # the original error matters more
        error.add_note(
            f"{physical} could not be dropped ({failed}); `quarry prune` removes it later"
        )


def _guard_lost_documents(
    alias: str, served: Mapping[str, DocState], target: VectorStore, fraction: float
) -> None:
    """Refuse a new collection that lacks too many of the documents the alias serves."""
    kept = target.index_state().keys()
    lost = [state for doc_id, state in served.items() if doc_id not in kept]
    what = f"the new collection {target.resolve()} (dropped)"
    _refuse_lost(alias, what, lost, served, fraction)


def _refuse_identical(
    store: VectorStore,
    previous: str,
    live: Fingerprint,
    chunking: Mapping[str, Any],
    min_canary_cosine: float,
) -> None:
    """Refuse a rebuild of the stored chunks that would copy ``previous`` as it is: the
    same model served the same way, the same query task, the same chunk settings. The
    copy would also push the collection the alias served before out of what
    ``prune --keep 2`` keeps."""
    stored = store.fingerprint(previous)
    if (
        stored is None
        or stored.model_key != live.model_key
        or stored.serving != live.serving
        # Queries take the task the index records: a reindex is how a new
        # QUARRY_QUERY_TASK gets recorded.
        or query_task_changed(stored, live)
        # The service says it is the same model but embeds otherwise (an image re-pulled
        # under the same tag): the rebuild is what the canary refusal asked for.
        or cosine(stored.canary, live.canary) < min_canary_cosine
        or dict(store.metadata(previous).get(META_CHUNKING) or {}) != dict(chunking)
    ):
        return
    raise Refused(
        f"{store.alias!r} is served by {previous}, built by {live.model.describe()} served "
        "as it is now, with the same query task and chunk settings: a reindex would only "
        "copy it. Pass "
        "--force to rebuild it all the same, or --from-source PATH to re-read the files "
        "(a deployment: -p force=true, -p 'from_source=[\"PATH\"]')"
    )


def _source_of(state: DocState) -> str:
    return state.uri.split("/", 1)[0]


def _refuse_lost(
    alias: str, what: str, lost: Sequence[DocState], served: Mapping[str, DocState], fraction: float
) -> None:
    """Refuse when some source would lose more than ``fraction`` of its documents (as an
    ingest's guard does, per source: a small source dropped whole counts)."""
    per_source = collections.Counter(_source_of(state) for state in served.values())
    lost_per_source = collections.Counter(_source_of(state) for state in lost)
    over = sorted(name for name, n in lost_per_source.items() if n / per_source[name] > fraction)
    if not over:
        return
    shown = ", ".join(
        f"{name} ({lost_per_source[name]} of {per_source[name]})" for name in over[:5]
    )
    rule = (
        "sources left out of --from-source"
        if fraction == 0.0
        else f"sources losing more than QUARRY_MAX_DELETE_FRACTION={fraction:.0%}"
    )
    raise MassDeleteRefused(
        f"{what} would leave out {len(lost)} of the {len(served)} documents {alias!r} "
        f"serves; {rule}: "
        f"{shown}{', ...' if len(over) > 5 else ''}. Give --from-source every source "
        "(repeat the option), with the --include/--exclude globs they were ingested with, "
        "or rerun with --allow-mass-delete (a deployment: -p allow_mass_delete=true) if this "
        "is intended. The alias was not switched."
    )


def rollback(store: VectorStore, to: str | None = None) -> tuple[str, str]:
    """Point the alias back at the collection it served before the last reindex, or at
    ``to``, another complete collection of the alias (undoing a rollback). Returns
    (the collection it served, the one it serves now)."""
    current = store.alias_target()
    if current is None:
        store.refuse_a_collection_name()
        raise StoreError(store.alias, "does not exist; nothing to roll back")
    known = {info.name: info for info in store.collections()}
    if to is not None:
        info = known.get(to)
        if info is None:
            raise StoreError(
                store.alias, f"{to} is not one of its collections (`quarry collections` lists them)"
            )
        if unfinished(info):
            raise StoreError(
                store.alias,
                f"{to} is a reindex's build that was never switched to "
                f"({info.metadata.get(META_BUILD)}): it may be incomplete, so the alias "
                "does not move to it",
            )
        if to != current:
            store.point_alias(to)
        return current, to
    previous = store.metadata(current).get(META_PREVIOUS)
    if not previous:
        raise StoreError(
            store.alias,
            f"{current} was not built by a reindex over another collection; nothing to "
            "roll back to (`quarry rollback --to NAME` points the alias at another of its "
            "collections, which `quarry collections` lists)",
        )
    if previous not in known:
        raise StoreError(
            store.alias,
            f"{current} was built over {previous}, which no longer exists (pruned); "
            "nothing to roll back to",
        )
    store.point_alias(str(previous))
    return current, str(previous)


def unfinished(info: CollectionInfo) -> bool:
    """True for a reindex's build that was never switched to: killed mid-way, or refused."""
    return info.metadata.get(META_BUILD) in (BUILDING, REFUSED)


def prune(store: VectorStore, keep: int) -> list[str]:
    """Delete this alias's older physical collections; returns the names deleted.

    Kept: the one the alias serves, then the one it would roll back to, then the
    newest others that served or could have (a build killed mid-way or refused by
    the gate goes first), ``keep`` in all (the served one always).
    """
    if keep < 1:
        raise ValueError("--keep must be at least 1")
    current = store.alias_target()
    if current is None:
        store.refuse_a_collection_name()  # a build's name for the alias: it has no builds
    collections: list[CollectionInfo] = store.collections()  # newest first
    rollback_to = store.metadata(current).get(META_PREVIOUS) if current else None
    ranked = sorted(
        collections,
        key=lambda info: (
            info.name != current,
            info.name != rollback_to,
            unfinished(info),  # a killed or refused build goes before any that served
        ),
    )  # stable: the rest stay newest first
    dropped: list[str] = []
    for rank, info in enumerate(ranked):
        if rank < keep or info.name == current:
            continue
        store.drop(info.name)
        dropped.append(info.name)
    return dropped
