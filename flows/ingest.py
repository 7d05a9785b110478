"""Ingestion flow: discover -> chunk -> embed -> upsert -> clean, for one or more sources.

Scheduled nightly (deployment ``ingest-nightly``) or run on demand
(``quarry ingest``). The algorithm lives in :mod:`quarry.ingest`; this module
decides what runs where: each batch of documents is a Prefect task, at most
``QUARRY_WORKERS`` in flight, and one ingest per collection at a time.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import quiet_quarry_tracebacks, take_back_sigterm
from quarry.chunking import Chunker
from quarry.config import Settings, get_settings
from quarry.documents import Document
from quarry.errors import IngestIncomplete, QuarryError, ServiceUnavailable, StoreLocked
from quarry.ingest import (
    PROGRESS_SECONDS,
    BatchResult,
    IndexSync,
    IngestProgress,
    IngestReport,
    run_sync,
)
from quarry.services import open_services
from quarry.sources import DEFAULT_EXCLUDE, SourceSpec, open_source, refuse_overlapping_sources
from quarry.store import writer_lock_path


# No Prefect retries: the clients own retries of transient failures, and a
# document that fails here is reported, not repeated.
@task(name="embed-and-write", cache_policy=NO_CACHE)
def write_documents(sync: IndexSync, documents: list[Document]) -> BatchResult:
    """Chunk, embed and upsert one batch of documents (idempotent: point ids are deterministic)."""
    return sync.write_batch(documents)


ProgressCallback = Callable[[IngestProgress], None]
# Set by an interactive caller (the CLI) to draw a live progress line; a deployment leaves it unset.
INGEST_PROGRESS: ContextVar[ProgressCallback | None] = ContextVar(
    "quarry_ingest_progress", default=None
)


@contextmanager
def _progress_reporter(
    logger: Any, live: ProgressCallback | None, every: float = PROGRESS_SECONDS
) -> Iterator[ProgressCallback]:
    """A progress callback that passes each update to ``live`` and, from a thread of
    its own, logs the latest every ``every`` seconds: what a
    deployment's log shows of a long run, even while one batch takes longer than that."""
    latest: list[IngestProgress] = []
    finished = threading.Event()

    def report(progress: IngestProgress) -> None:
        if live is not None:
            live(progress)
        latest[:] = [progress]

    def log_latest() -> None:
        while not finished.wait(every):
            if latest:
                logger.info("progress: %s", latest[-1].describe())

    ticker = threading.Thread(target=log_latest, name="quarry-progress-log", daemon=True)
    ticker.start()
    try:
        yield report
    finally:
        finished.set()
        ticker.join()


@contextmanager
def one_writer(settings: Settings, collection: str, *, wait: bool = True) -> Iterator[None]:
    """Serialise quarry's writers of one collection: ingest, reindex, prune, rollback.

    A Prefect global concurrency limit (``quarry-ingest-<collection>``) when a Qdrant
    server is shared by workers; a file lock beside local-mode Qdrant otherwise. A
    flow waits its turn; an operator's quick command (``wait=False``) raises
    :class:`StoreLocked` at once instead, so ``prune`` never deletes the collection a
    running reindex is building.
    """
    if settings.qdrant_url:
        import httpx
        from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
        from prefect.concurrency.sync import concurrency

        name = f"quarry-ingest-{collection}"
        if not wait:
            # Prefect also logs the refused acquisition as an ERROR from its own
            # thread; the StoreLocked below says it once, and plainly.
            noisy = logging.getLogger("prefect._internal.concurrency")
            if _not_a_refused_slot not in noisy.filters:
                noisy.addFilter(_not_a_refused_slot)
        with ExitStack() as held:
            try:
                held.enter_context(
                    concurrency(
                        name,
                        occupy=1,
                        strict=False,
                        max_retries=None if wait else 0,
                        timeout_seconds=settings.writer_wait if wait else None,
                    )
                )
            except TimeoutError:
                raise _waited_too_long(settings, collection, repr(collection)) from None
            except ConcurrencySlotAcquisitionError as error:
                # Prefect raises this for every failure to take the slot: only a 423 is
                # a slot another run holds (a flow, retrying for ever, never sees one).
                cause = error.__cause__
                if not (
                    isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423
                ):
                    from prefect.settings import PREFECT_API_URL

                    raise ServiceUnavailable(
                        str(PREFECT_API_URL.value() or "the Prefect API"),
                        f"could not take the Prefect concurrency limit {name!r}: {cause or error}",
                    ) from None
                raise StoreLocked(
                    collection,
                    f"an ingest or reindex of {collection!r} is running (it holds the "
                    f"Prefect concurrency limit {name!r}); try again when it has finished",
                ) from None
            yield
        return
    # Local-mode Qdrant admits one process per folder, whatever the collection,
    # so the lock is per data folder: a second ingest waits instead of failing.
    lock_path = writer_lock_path(settings)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            raise StoreLocked(
                collection,
                f"an ingest or reindex is writing to local-mode Qdrant in "
                f"{settings.data_dir}; try again when it has finished",
            ) from None
        get_run_logger().warning(
            "another ingest or reindex is writing to local-mode Qdrant in %s; waiting for it"
            + ("" if settings.writer_wait is None else f" (at most {settings.writer_wait:g}s)"),
            settings.data_dir,
        )
        try:
            lock.acquire(timeout=-1 if settings.writer_wait is None else settings.writer_wait)
        except Timeout:
            raise _waited_too_long(
                settings, collection, f"local-mode Qdrant in {settings.data_dir}"
            ) from None
    try:
        yield
    finally:
        lock.release()


def _waited_too_long(settings: Settings, collection: str, written: str) -> StoreLocked:
    """The run gave up waiting for the writer of ``written`` (a collection, or the
    local-mode folder that every collection in it shares)."""
    return StoreLocked(
        collection,
        f"another ingest or reindex was still writing to {written} after "
        f"{settings.writer_wait:g}s (QUARRY_WRITER_WAIT); nothing was read or written: "
        "run again when it has finished",
    )


def _not_a_refused_slot(record: logging.LogRecord) -> bool:
    return "ConcurrencySlotAcquisition" not in record.getMessage()


def source_specs(
    paths: list[str],
    include: list[str] | None,
    exclude: list[str] | None,
    *,
    missing_file_ok: bool = False,
    encoding: str | None = None,
) -> list[SourceSpec]:
    """Open each path as a source with the given globs; ``exclude`` adds to the default
    skips (.git, node_modules, .venv, ...) instead of replacing them. With
    ``missing_file_ok`` a file that is gone is a source too (an ingest removes its
    documents); a reindex must read every path it is given. ``encoding`` decodes
    their files that are not UTF-8 (default: detected)."""
    globs: dict[str, Any] = {}
    if include:
        globs["include"] = tuple(include)
    if exclude:
        globs["exclude"] = DEFAULT_EXCLUDE + tuple(exclude)
    specs = [
        open_source(path, **globs, missing_file_ok=missing_file_ok, encoding=encoding)
        for path in paths
    ]
    refuse_overlapping_sources(specs)
    return specs


@flow(name="quarry-ingest", log_prints=False)
def ingest_flow(
    sources: list[str],
    collection: str | None = None,
    full_sync: bool = True,
    allow_mass_delete: bool = False,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    reread: bool = False,
    encoding: str | None = None,
    fail_on_failures: bool = False,
) -> dict[str, Any]:
    """Sync ``sources`` (folders or files) into ``collection``.

    Args:
        sources: Paths to index; each folder is one source, named after the folder.
        collection: The alias to write to (default ``QUARRY_COLLECTION``).
        full_sync: Delete documents gone from a source (scoped to that source).
        allow_mass_delete: Allow a sync to delete more than ``QUARRY_MAX_DELETE_FRACTION``.
        include: Globs of files to index (default: md, txt, rst, html, pdf).
        exclude: Globs of files to skip, besides the default ones (.git, node_modules, ...).
        reread: Read and hash every file, even one whose mtime and size are those its
            documents were indexed from (after restoring files with old mtimes, say).
        encoding: The encoding of the sources' text files that are not UTF-8, such as
            ``cp1251`` or ``shift_jis`` (default: detected, which can misread a file of
            a sentence or two). Files read before with another setting are read again.
        fail_on_failures: End the run Failed (raising IngestIncomplete, whose ``summary``
            is the run's) when a file or document could not be indexed, so an automation
            on failed runs pages someone; everything else is indexed all the same.

    Returns:
        The ingest summary (``IngestReport.to_dict()``).
    """
    quiet_quarry_tracebacks()  # a deployment's log, as the CLI's: the error says it all
    take_back_sigterm()
    logger = get_run_logger()
    settings = get_settings(collection=collection)
    started = time.monotonic()
    try:
        specs = source_specs(sources, include, exclude, missing_file_ok=True, encoding=encoding)
        with (
            one_writer(settings, settings.collection),
            open_services(settings) as services,
            _progress_reporter(logger, INGEST_PROGRESS.get()) as progress,
        ):
            sync = IndexSync(
                services.store,
                services.embedder,
                Chunker(settings.chunk_tokens, settings.chunk_overlap),
                embed_headings=settings.embed_headings,
                max_delete_fraction=settings.max_delete_fraction,
                allow_serving_change=settings.allow_serving_change,
                canary_min_cosine=settings.canary_min_cosine,
                trust_file_stamps=settings.trust_file_stamps and not reread,
            )
            report = run_sync(
                sync,
                specs,
                full_sync=full_sync,
                allow_mass_delete=allow_mass_delete,
                max_file_bytes=settings.max_file_bytes,
                submit=write_documents.submit,
                window=settings.workers,
                log=logger,
                progress=progress,
            )
    except QuarryError as error:
        # The UI's artifact for the collection says the last run failed, and why; a
        # Prefect API that cannot take it must not hide the error itself.
        try:
            _publish_failure(settings.collection, sources, error, time.monotonic() - started)
        except Exception as publishing:
            logger.warning("could not publish the failure artifact: %s", publishing)
        raise
    elapsed = time.monotonic() - started
    logger.info(
        "ingest of %s: %d seen, %d skipped, %d embedded (%d new, %d changed; %d chunks, "
        "%d reused), %d deleted, %d failed in %.1fs",
        settings.collection,
        report.documents_seen,
        report.documents_skipped,
        report.documents_embedded,
        report.documents_added,
        report.documents_updated,
        report.chunks_embedded,
        report.chunks_reused,
        report.documents_deleted,
        report.documents_failed,
        elapsed,
    )
    _publish_artifact(report, sources, elapsed)
    if fail_on_failures and report.documents_failed:
        raise IngestIncomplete(settings.collection, report.to_dict())
    return report.to_dict()


def _artifact_key(collection: str) -> str:
    """``ingest-<collection>``; Prefect's keys are lowercase letters, digits and dashes,
    so a name that is not gets a short hash of itself (``My_Docs`` and ``my-docs``
    would share a key otherwise)."""
    key = collection.lower().replace("_", "-")
    if key != collection:
        key += "-" + hashlib.sha256(collection.encode("utf-8")).hexdigest()[:6]
    return f"ingest-{key}"


def _cell(text: str) -> str:
    """``text`` for a Markdown table cell: GFM splits cells at every ``|``, inside a code
    span too, unless it is escaped."""
    return text.replace("|", "\\|")


def _sources_line(sources: list[str]) -> str:
    return f"Sources: {', '.join(f'`{Path(s)}`' for s in sources)}"


def _publish_failure(
    collection: str, sources: list[str], error: QuarryError, elapsed: float
) -> None:
    lines = [
        f"# Ingest of `{collection}` failed",
        "",
        _sources_line(sources),
        "",
        f"After {elapsed:.1f} s: {error}",
        "",
        "Nothing it wrote is lost or doubled: a rerun picks up where it stopped.",
    ]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key=_artifact_key(collection),
        description=f"quarry ingest summary for {collection} (failed)",
    )


def _publish_artifact(report: IngestReport, sources: list[str], elapsed: float) -> None:
    lines = [
        f"# Ingest of `{report.collection}`",
        "",
        _sources_line(sources),
        "",
        "| documents seen | skipped | embedded | new | changed | deleted | failed | chunks "
        "| reused | tokens | seconds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {report.documents_seen} | {report.documents_skipped} | {report.documents_embedded} "
        f"| {report.documents_added} | {report.documents_updated} | {report.documents_deleted} "
        f"| {report.documents_failed} | {report.chunks_embedded} "
        f"| {report.chunks_reused} | {report.tokens_embedded} | {elapsed:.1f} |",
    ]
    if report.failures:
        lines += ["", "## Failures", "", "| document | error |", "|---|---|"]
        lines += [
            f"| `{_cell(failure.uri)}` | {failure.error.replace('|', '/')} |"
            for failure in report.failures
        ]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key=_artifact_key(report.collection),
        description=f"quarry ingest summary for {report.collection}",
    )
