"""The ``quarry`` command line.

Every command takes ``--json`` for a machine-readable result on stdout (a failure
too, the option parser's usage errors included: ``{"error": {"type", "message",
"exit_code"}}``); logs, progress and error lines go to stderr.
Exit codes: 0 ok, 1 failed, 2 usage, 3 refused, 130 interrupted (143: SIGTERM).
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, closing, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from quarry.config import Settings, describe_invalid, get_settings, http_url, unknown_settings
from quarry.errors import (
    ConfigError,
    QuarryError,
    QueryTooLong,
    Refused,
    SourceNotFound,
)

if TYPE_CHECKING:
    from quarry.search import SearchResponse

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
EXIT_INCOMPLETE = 4  # ingest --fail-on-failures: done, but some documents failed
QUERY_RERANK_RETRY_S = 5.0
"""The most `quarry query` waits on a failing reranker it can answer without."""
# What `quarry reindex` calls the parameters that quarry.reindex.refuse_bad_parameters names.
_REINDEX_FLAGS = {
    "eval_dataset": "--eval DATASET",
    "min_ndcg": "--min-ndcg",
    "eval_split": "--eval-split",
    "from_source": "--from-source PATH",
    "include": "--include",
    "exclude": "--exclude",
    "encoding": "--encoding",
}
_RERANK_CAP = "quarry query's cap for a reranker not required (QUARRY_RERANK_REQUIRED)"

app = typer.Typer(
    name="quarry",
    help="Index documents into Qdrant with your own embedding models, and search them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: Rich's tables squeeze an 80-column terminal until option names are
    # cut short ("--allow-mass-dele…") and print a type beside every flag ("<bool>").
    rich_markup_mode=None,
)


def _print_version(asked: bool) -> None:
    if asked:
        from quarry import __version__
        from quarry._build_info import chunker_build

        typer.echo(f"quarry {__version__} ({chunker_build()})")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _global_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Index documents into Qdrant with your own embedding models, and search them."""


JsonFlag = Annotated[bool, typer.Option("--json", help="Print a JSON result on stdout.")]
CollectionOption = Annotated[
    str | None,
    typer.Option(
        "--collection", "-c", metavar="NAME", help="Collection alias (QUARRY_COLLECTION)."
    ),
]
EncodingOption = Annotated[
    str | None,
    typer.Option(
        "--encoding",
        metavar="ENCODING",
        help="Encoding of text files that are not UTF-8, such as cp1251 or shift_jis "
        "(default: detected, which can misread a file of a sentence or two).",
    ),
]


# Set by main() when the command line asks for --json: a failure is then a JSON object
# on stdout too, so a script that parses stdout learns why the run failed.
_json_errors = False
# Set once a stopped ingest or reindex has said so (on stderr, and on stdout with --json).
_stop_reported = False
# Set once a failure has been said (``_fail``): main() then adds nothing.
_failure_reported = False
# The exit code of a command whose result ``_emit`` has printed (None before that): a
# Ctrl-C after the result was printed does not make the command "interrupted".
_emitted_code: int | None = None
# Set once a result began to be written as it is made (quarry chunk): an error after
# that goes to stderr only, never as a second JSON object after a cut-off first.
_output_started = False
_ERROR_KINDS = {
    EXIT_FAILED: "failed",
    EXIT_USAGE: "usage",
    EXIT_REFUSED: "refused",
    130: "interrupted",  # SIGINT (Ctrl-C)
    143: "interrupted",  # SIGTERM
}


def _utf8_text(text: str) -> str:
    """``text`` as valid UTF-8: a path or argument the OS gave as bytes that are not
    UTF-8 (held as surrogate escapes) has each such byte as U+FFFD, as failures do."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        data = text.encode("utf-8", "replace")
    return data.decode("utf-8", "replace")


def _echo_json_error(message: str, code: int) -> None:
    if _output_started:  # stdout holds a result cut short: the exit code and stderr say it
        return
    message = _utf8_text(message)
    error = {"type": _ERROR_KINDS.get(code, "failed"), "message": message, "exit_code": code}
    typer.echo(_json_text({"error": error}))


def _json_when_stopped(code: int, message: str) -> None:
    """An ingest or reindex stopped by a signal: with --json, say so on stdout too."""
    global _stop_reported
    _stop_reported = True
    if _json_errors:
        _echo_json_error(message, code)


def _fail(message: str, code: int) -> NoReturn:
    global _failure_reported
    _failure_reported = True
    typer.echo(f"quarry: error: {message}", err=True)
    if _json_errors:
        _echo_json_error(message, code)
    raise typer.Exit(code)


@contextmanager
def _errors_to_exit_codes() -> Iterator[None]:
    """Map quarry's errors to exit codes with one clear line on stderr, no traceback."""
    try:
        yield
    except SourceNotFound as error:
        _fail(str(error), EXIT_USAGE)
    except Refused as error:
        _fail(f"refused: {_with_notes(error)}", EXIT_REFUSED)
    except ConfigError as error:
        _fail(_with_notes(error), EXIT_USAGE)
    except QuarryError as error:
        _fail(_with_notes(error), EXIT_FAILED)
    except ValidationError as error:  # settings read again inside a flow
        _fail(f"invalid setting: {describe_invalid(error)}", EXIT_USAGE)
    except ValueError as error:
        # Settings and flags are checked before any work (the branches above): a value
        # error here is a failure on the way (an answer quarry could not read), not the
        # user's input (review: a service's odd Retry-After said "invalid setting").
        _fail(str(error) or type(error).__name__, EXIT_FAILED)
    except KeyboardInterrupt:
        # typer turns an uncaught KeyboardInterrupt into a silent exit 130: say so.
        if _stop_reported:  # an ingest or reindex already did
            raise
        _fail("interrupted", 130)


def _with_notes(error: BaseException) -> str:
    """The error's message, then what was noted on it on its way up (``add_note``:
    the alias was not switched, a build could not be dropped)."""
    return "; ".join([str(error), *getattr(error, "__notes__", ())])


def _settings(**overrides: Any) -> Settings:
    for problem in unknown_settings(os.environ):
        typer.echo(f"quarry: warning: {problem}", err=True)
    try:
        return get_settings(**overrides)
    except ValidationError as error:
        _fail(f"invalid setting: {describe_invalid(error)}", EXIT_USAGE)


@contextmanager
def _ingest_progress() -> Iterator[None]:
    """A live progress line on an interactive stderr: files done of found, what was embedded."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from flows.ingest import INGEST_PROGRESS
    from quarry.ingest import IngestProgress

    columns = (
        SpinnerColumn(),
        BarColumn(bar_width=20),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting (Prefect, then the first batch)...", total=None)

        def show(state: IngestProgress) -> None:
            progress.update(
                task,
                description=state.describe(),
                total=state.files_found or None,
                completed=state.files_done,
            )

        token = INGEST_PROGRESS.set(show)
        try:
            yield
        finally:
            INGEST_PROGRESS.reset(token)


def _preflight(settings: Settings) -> None:
    """Fail fast, before Prefect starts, when the configured services do not answer, or
    when another process (the API, a query) holds local-mode Qdrant. Another ingest
    holding it is waited for, later, under the writers' lock."""
    if not settings.qdrant_url:
        from quarry.store import local_mode_locked, local_store_held, writer_lock_held

        if local_store_held(settings) and not writer_lock_held(settings):
            raise local_mode_locked(settings)
    if settings.embed_url:
        from quarry.embeddings import EmbeddingClient
        from quarry.services import retry_policy

        with EmbeddingClient(
            settings.embed_url,
            api_key=settings.embed_api_key.get_secret_value() if settings.embed_api_key else None,
            retry=retry_policy(settings),
        ) as client:
            _ = client.info
    if settings.qdrant_url:
        from quarry.store import open_client

        open_client(settings).close()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _json_text(data: Any, **options: Any) -> str:
    """``data`` as JSON for stdout: text as it is (CJK, emoji) where stdout takes UTF-8."""
    readable = (sys.stdout.encoding or "").lower().replace("-", "") == "utf8"
    return json.dumps(data, ensure_ascii=not readable, default=str, **options)


def _emit(
    as_json: bool, data: dict[str, Any], human: Callable[[], None], code: int = EXIT_OK
) -> None:
    """Print a command's result (``data`` with --json, else ``human()``); ``code`` is the
    exit code that result stands for."""
    # A Ctrl-C while the result is being written is let go: the work is done, and a
    # result cut short (or followed by an "interrupted" object) would mislead a script.
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    try:
        if as_json:
            typer.echo(_json_text(data, indent=2))
        else:
            human()
        _done_writing(code)
    finally:
        signal.signal(signal.SIGINT, previous)


def _stream_json(key: str, items: Iterable[dict[str, Any]], rest: Mapping[str, Any]) -> None:
    """Write ``{key: [*items], **rest}`` as :func:`_emit` would (indented by 2), an item
    at a time as ``items`` yields them. A Ctrl-C cuts it short (exit 130, the JSON
    unfinished): unlike a result already made, the writing is the work."""
    global _output_started
    _output_started = True
    write = sys.stdout.write
    write("{\n" + f"  {_json_text(key)}: [")
    first = True
    for item in items:
        item_text = _json_text(item, indent=2).replace("\n", "\n    ")
        write(("\n    " if first else ",\n    ") + item_text)
        first = False
    write("]" if first else "\n  ]")
    for name, value in rest.items():
        write(f",\n  {_json_text(name)}: " + _json_text(value, indent=2).replace("\n", "\n  "))
    write("\n}\n")
    _done_writing(EXIT_OK)


def _done_writing(code: int) -> None:
    """Note that a command's whole result was written, standing for exit ``code``."""
    global _emitted_code
    _emitted_code = code


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(metavar="PATH", help="Folders or files to index.")],
    collection: CollectionOption = None,
    full_sync: Annotated[
        bool,
        typer.Option("--full-sync/--no-full-sync", help="Delete documents gone from each source."),
    ] = True,
    allow_mass_delete: Annotated[
        bool, typer.Option(help="Allow deleting more than QUARRY_MAX_DELETE_FRACTION.")
    ] = False,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            metavar="GLOB",
            help="Glob of files to index (repeatable). Replaces the default ones "
            # Written out: importing quarry.sources here would slow every command's start.
            "(**/*.md, .markdown, .txt, .rst, .html, .htm, .pdf): to add to them, give them too.",
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option("--exclude", metavar="GLOB", help="Glob of files to skip (repeatable)."),
    ] = None,
    reread: Annotated[
        bool,
        typer.Option(
            "--reread",
            help="Read and hash every file, even one whose mtime and size are as indexed.",
        ),
    ] = False,
    encoding: EncodingOption = None,
    fail_on_failures: Annotated[
        bool,
        typer.Option(
            "--fail-on-failures",
            help="Exit 4 (and end the flow run Failed) when a file or document could not be "
            "indexed; the rest is indexed all the same.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Index PATHs: new and changed documents are embedded, unchanged ones skipped."""
    settings = _settings(collection=collection)
    with _errors_to_exit_codes():
        from quarry.sources import open_source, refuse_overlapping_sources

        # A file that is gone is still a source (syncing it removes its documents);
        # a path whose folder is gone too is refused here, as SourceNotFound.
        specs = [open_source(p, missing_file_ok=True, encoding=encoding) for p in paths]
        refuse_overlapping_sources(specs)
        _preflight(settings)
        if not all(path.exists() for path in paths):
            # A named file that is gone: refuse a typo before Prefect starts.
            from quarry.ingest import as_indexed, refuse_unknown_missing_files
            from quarry.store import VectorStore, open_client

            with closing(VectorStore(open_client(settings), settings.collection)) as store:
                refuse_unknown_missing_files(store, [as_indexed(store, s) for s in specs])
    from flows import configure_prefect_environment, embedded_flow_runs, quiet_quarry_tracebacks

    with _errors_to_exit_codes():
        configure_prefect_environment(settings.data_dir)
    quiet_quarry_tracebacks()
    stopped = "a rerun picks up where this one stopped (nothing is lost or written twice)"
    with (
        _errors_to_exit_codes(),
        _ingest_progress(),
        embedded_flow_runs(stopped, on_stop=_json_when_stopped, exit_when_stopped=True),
    ):
        from flows.ingest import ingest_flow
        from quarry.errors import IngestIncomplete

        incomplete: IngestIncomplete | None = None
        try:
            summary = ingest_flow(
                sources=[str(path) for path in paths],
                collection=settings.collection,
                full_sync=full_sync,
                allow_mass_delete=allow_mass_delete,
                include=include,
                exclude=exclude,
                reread=reread,
                encoding=encoding,
                fail_on_failures=fail_on_failures,
            )
        except IngestIncomplete as error:  # the summary is printed all the same
            incomplete, summary = error, error.summary

    def human() -> None:
        typer.echo(
            f"{summary['collection']}: {_count(summary['documents_seen'], 'document')} seen, "
            f"{summary['documents_skipped']} unchanged "
            f"({_count(summary['files_unread'], 'file')} not read), "
            f"{summary['documents_embedded']} embedded "
            f"({summary['documents_added']} new, {summary['documents_updated']} changed; "
            f"{_count(summary['chunks_embedded'], 'chunk')}, "
            + (f"{summary['chunks_reused']} reused, " if summary.get("chunks_reused") else "")
            + f"{_count(summary['embedding_requests'], 'request')}), "
            f"{summary['documents_deleted']} deleted, {summary['documents_failed']} failed"
        )
        for failure in summary["failures"]:
            typer.echo(f"  failed: {failure['uri']}: {failure['error']}")
        for note in summary.get("notes", []):
            typer.echo(f"  note: {note}")

    _emit(as_json, summary, human, EXIT_OK if incomplete is None else EXIT_INCOMPLETE)
    if incomplete is not None:
        # Not an error object on stdout: the summary there says what failed, and how much.
        typer.echo(f"quarry: error: {incomplete}", err=True)
        raise typer.Exit(EXIT_INCOMPLETE)


@app.command()
def query(
    text: Annotated[str, typer.Argument(metavar="TEXT", help="The question.")],
    collection: CollectionOption = None,
    k: Annotated[
        int, typer.Option("-k", min=1, max=100, metavar="N", help="Passages to return.")
    ] = 5,
    candidates: Annotated[
        int, typer.Option(min=1, max=1000, metavar="N", help="Vector candidates.")
    ] = 50,
    no_rerank: Annotated[bool, typer.Option("--no-rerank", help="Vector scores only.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Search the collection and print the best passages with their scores and sources."""
    from quarry.search import is_blank_query

    if is_blank_query(text):
        _fail(
            "the query is empty (whitespace or invisible characters only): give a question "
            "(quarry query TEXT)",
            EXIT_USAGE,
        )
    # Bytes the locale could not decode (a non-UTF-8 locale, or invalid UTF-8): taken
    # as UTF-8, each invalid byte as U+FFFD.
    text = _utf8_text(text)
    settings = _settings(collection=collection)
    with _errors_to_exit_codes():
        from quarry.search import Searcher
        from quarry.services import open_services

        # A reranker the answer can do without is not waited on for the whole
        # QUARRY_RETRY_BUDGET (30 s), only long enough for a restart.
        cap = None if settings.rerank_required else (QUERY_RERANK_RETRY_S, _RERANK_CAP)
        with open_services(settings, rerank_retry_cap=cap) as services:
            searcher = Searcher(
                services.store,
                services.embedder,
                services.reranker,
                threshold=settings.rerank_threshold,
                rerank_required=settings.rerank_required,
                allow_serving_change=settings.allow_serving_change,
                canary_min_cosine=settings.canary_min_cosine,
            )
            try:
                response = searcher.search(
                    text, top_k=k, candidates=candidates, rerank=not no_rerank
                )
            except QueryTooLong as error:  # the question's fault, not the service's
                _fail(str(error), EXIT_USAGE)

    def human() -> None:
        print_response(response)

    _emit(as_json, response.to_dict(), human)


def print_response(response: SearchResponse) -> None:
    """Print ranked passages with scores and sources, for people."""
    for warning in response.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if not response.results:
        typer.echo("no passage scored above the threshold")
    for rank, result in enumerate(response.results, start=1):
        where = " > ".join(result.headings)
        suffix = f"  [{where}]" if where else ""
        typer.echo(f"{rank}. {result.score:.3f}  {result.uri}{suffix}")
        snippet = " ".join(result.text.split())
        typer.echo(f"   {snippet[:300]}{'...' if len(snippet) > 300 else ''}")


@app.command()
def chunk(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A file to split.", exists=False)],
    max_tokens: Annotated[
        int | None, typer.Option(min=16, metavar="N", help="Chunk size in tokens.")
    ] = None,
    overlap: Annotated[
        int | None, typer.Option(min=0, metavar="N", help="Overlap in tokens.")
    ] = None,
    encoding: EncodingOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Show how FILE will be split into chunks."""
    settings = _settings(chunk_tokens=max_tokens, chunk_overlap=overlap)
    if file.is_dir():
        _fail(f"{file}: is a directory; give one file (quarry chunk FILE)", EXIT_USAGE)
    if not file.exists() and not file.is_symlink():
        _fail(f"{file}: no such file", EXIT_USAGE)
    with _errors_to_exit_codes():
        from quarry.chunking import Chunker
        from quarry.errors import UnreadableDocument
        from quarry.sources import load_path

        chunker = Chunker(settings.chunk_tokens, settings.chunk_overlap)
        try:
            documents = load_path(file, max_file_bytes=settings.max_file_bytes, encoding=encoding)
        except UnreadableDocument as error:
            # Named as given (not by the uri an ingest would use), and nothing is "skipped".
            reason = re.sub(r"[,;] skipped$", "", error.reason)
            raise UnreadableDocument(str(file), reason) from None
        # What the file was read as: a legacy encoding is detected unless --encoding says.
        read_as = (
            documents[0].metadata.get("encoding", "utf-8")
            if documents and documents[0].metadata.get("content_type") != "application/pdf"
            else None
        )
        if read_as not in (None, "utf-8") and not as_json:
            typer.echo(f"{file}: read as {read_as}", err=True)
        # A PDF is one document per page: each chunk says which, its offsets are into it.
        # Written as they are made: a 200 MB file's chunks are never all held, nor its JSON.
        chunks = ((d, c) for d in documents for c in chunker.iter_chunks(d))
        if as_json:
            _stream_json(
                "chunks",
                (
                    {
                        "uri": d.uri,
                        "page": d.metadata.get("page"),
                        "index": c.index,
                        "text": c.text,
                        "token_count": c.token_count,
                        "headings": list(c.headings),
                        "char_start": c.char_start,
                        "char_end": c.char_end,
                    }
                    for d, c in chunks
                ),
                {"encoding": read_as},
            )
            return
        written = 0
        for d, c in chunks:
            where = " > ".join(c.headings)
            page = d.metadata.get("page")
            typer.echo(
                f"--- chunk {c.index}"
                + (f" of page {page}" if page is not None else "")
                + f": {c.token_count} tokens, chars {c.char_start}-{c.char_end}"
                + (f" [{where}]" if where else "")
            )
            typer.echo(c.text)
            written += 1
        if not written:
            typer.echo(f"{file}: no text, so no chunks (an ingest indexes nothing of it)")
        _done_writing(EXIT_OK)


def _accepted_serving(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Serving stacks `quarry parity --accept` admitted, each with when it was measured."""
    from quarry.store import META_ACCEPTED_SERVING, META_PARITY

    measured = {
        json.dumps(record.get("candidate_serving"), sort_keys=True): record.get("measured_at")
        for record in metadata.get(META_PARITY) or []
        if isinstance(record, dict) and record.get("accepted")
    }
    return [
        {**entry, "accepted_at": measured.get(json.dumps(entry, sort_keys=True))}
        for entry in metadata.get(META_ACCEPTED_SERVING) or []
        if isinstance(entry, dict)
    ]


def _serving_line(entry: Mapping[str, Any]) -> str:
    from quarry.fingerprint import ServingIdentity

    limit = entry.get("max_input_length")
    return ServingIdentity(
        engine=str(entry.get("engine") or "?"),
        engine_version=entry.get("engine_version"),
        dtype=entry.get("dtype"),
        max_input_length=limit if isinstance(limit, int) else None,
    ).describe()


@app.command()
def status(collection: CollectionOption = None, as_json: JsonFlag = False) -> None:
    """Show the collection: where the alias points, its size and the model that built it."""
    settings = _settings(collection=collection)
    with _errors_to_exit_codes():
        from quarry.store import VectorStore, open_client

        store = VectorStore(open_client(settings), settings.collection)
        try:
            physical = store.resolve()
            aliases = [settings.collection]
            if physical is None and store.client.collection_exists(settings.collection):
                # A physical collection named directly (a candidate, a rollback target).
                physical = settings.collection
                store = store.view(physical)
                aliases = [
                    a.alias_name
                    for a in store.client.get_aliases().aliases
                    if a.collection_name == physical
                ]
            if physical is None:
                _fail(
                    f"collection {settings.collection!r} does not exist yet; "
                    "run `quarry ingest PATH`",
                    EXIT_FAILED,
                )
            fingerprint = store.fingerprint()
            documents = store.index_state()
            accepted = _accepted_serving(store.metadata())
            data = {
                "collection": physical,
                "alias": aliases[0] if aliases else None,
                "points": store.count(),
                "documents": len(documents),
                # Half-written by an interrupted run: the next ingest completes them.
                "documents_incomplete": sum(
                    1 for doc in documents.values() if not doc.is_complete()
                ),
                "fingerprint": fingerprint.to_metadata() if fingerprint else None,
                "accepted_serving": accepted,
            }
        finally:
            store.close()
    if isinstance(data["fingerprint"], dict):
        data["fingerprint"].pop("canary", None)

    def human() -> None:
        if data["alias"] is None:
            typer.echo(f"collection   {data['collection']} (no alias points at it)")
        else:
            typer.echo(f"alias        {data['alias']} -> {data['collection']}")
        typer.echo(f"points       {data['points']}")
        typer.echo(f"documents    {data['documents']}")
        if data["documents_incomplete"]:
            typer.echo(
                f"incomplete   {data['documents_incomplete']} (a write was interrupted; "
                "the next ingest completes them)"
            )
        if fingerprint:
            typer.echo(f"model        {fingerprint.model.describe()}")
            typer.echo(f"serving      {fingerprint.serving.describe()}")
            for entry in accepted:
                when = f", measured {entry['accepted_at']}" if entry["accepted_at"] else ""
                typer.echo(f"accepted     {_serving_line(entry)} (quarry parity --accept{when})")
            typer.echo(f"query task   {fingerprint.query_task}")

    _emit(as_json, data, human)


@app.command()
def collections(collection: CollectionOption = None, as_json: JsonFlag = False) -> None:
    """List the physical collections behind the alias, with the model that built each."""
    settings = _settings(collection=collection)
    with _errors_to_exit_codes():
        from quarry.reindex import BUILDING, META_BUILD, META_PREVIOUS, REFUSED
        from quarry.store import META_FINGERPRINT, VectorStore, open_client

        store = VectorStore(open_client(settings), settings.collection)
        try:
            found = store.collections()
            if not found:
                store.refuse_a_collection_name()  # a build's name given for the alias
        finally:
            store.close()
    rows: list[dict[str, Any]] = []
    names = {info.name for info in found}
    for info in found:
        fingerprint = dict(info.metadata.get(META_FINGERPRINT) or {})
        fingerprint.pop("canary", None)
        previous = info.metadata.get(META_PREVIOUS)
        rows.append(
            {
                "name": info.name,
                "aliases": list(info.aliases),
                "points": info.points,
                "fingerprint": fingerprint or None,
                # What a rollback returns to: none once prune has deleted it.
                "previous": previous if previous in names else None,
                # "building" (under way, or its reindex was killed), "refused" (kept by
                # the --min-ndcg gate), "complete"; null for one an ingest created.
                "build": info.metadata.get(META_BUILD),
            }
        )
    notes = {
        BUILDING: "  [incomplete: a reindex is building it or was stopped]",
        REFUSED: "  [refused by the --min-ndcg gate]",
    }

    live = next((row for row in rows if settings.collection in row["aliases"]), None)
    back_to = live["previous"] if live is not None else None

    def human() -> None:
        if not rows:
            typer.echo(f"no collections for alias {settings.collection!r}")
        for row in rows:
            model = (row["fingerprint"] or {}).get("model", {})
            serving = "*" if row is live else " "
            typer.echo(
                f"{serving} {row['name']}  {row['points']} points  "
                f"{model.get('model_id', '?')} ({model.get('dimensions', '?')}d)"
                + notes.get(row["build"], "")
                + ("  [quarry rollback returns here]" if row["name"] == back_to else "")
            )

    _emit(as_json, {"alias": settings.collection, "collections": rows}, human)


@app.command()
def reindex(
    collection: CollectionOption = None,
    from_source: Annotated[
        list[Path] | None,
        typer.Option(
            "--from-source", metavar="PATH", help="Re-read these paths instead of stored chunks."
        ),
    ] = None,
    eval_dir: Annotated[
        Path | None,
        typer.Option("--eval", metavar="DIR", help="BEIR dataset to evaluate before switching."),
    ] = None,
    min_ndcg: Annotated[
        float | None, typer.Option(metavar="X", help="Refuse to switch below this nDCG@10.")
    ] = None,
    eval_split: Annotated[
        str,
        typer.Option(
            "--eval-split", metavar="SPLIT", help="With --eval: which qrels/<split>.tsv to score."
        ),
    ] = "test",
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            metavar="GLOB",
            help="With --from-source: glob of files to index (repeatable).",
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude",
            metavar="GLOB",
            help="With --from-source: glob of files to skip (repeatable).",
        ),
    ] = None,
    allow_mass_delete: Annotated[
        bool,
        typer.Option(
            help="Switch even if the new collection lacks more than "
            "QUARRY_MAX_DELETE_FRACTION of the served documents."
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Rebuild even when the model, its serving and the settings match."
        ),
    ] = False,
    encoding: EncodingOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Rebuild the collection with the live model beside the old one, then switch the alias."""
    settings = _settings(collection=collection)
    for path in [*(from_source or []), *([eval_dir] if eval_dir else [])]:
        if not path.exists():
            _fail(f"{path}: no such file or directory", EXIT_USAGE)
    with _errors_to_exit_codes():
        from quarry.reindex import refuse_bad_parameters

        # Before Prefect starts (the flow checks them again, for deployment runs).
        refuse_bad_parameters(
            eval_dataset=eval_dir,
            min_ndcg=min_ndcg,
            eval_split=eval_split,
            from_source=bool(from_source),
            include=include,
            exclude=exclude,
            encoding=encoding,
            names=_REINDEX_FLAGS,
        )
        _preflight(settings)
    from flows import configure_prefect_environment, embedded_flow_runs, quiet_quarry_tracebacks

    with _errors_to_exit_codes():
        configure_prefect_environment(settings.data_dir)
    quiet_quarry_tracebacks()
    stopped = (
        "the alias moves only to a complete, verified collection, and an unfinished one "
        "is dropped; `quarry collections` shows where it points"
    )
    with (
        _errors_to_exit_codes(),
        embedded_flow_runs(
            stopped, clean_up_s=10.0, on_stop=_json_when_stopped, exit_when_stopped=True
        ),
    ):
        from flows.reindex import reindex_flow

        report = reindex_flow(
            collection=settings.collection,
            from_source=[str(p) for p in from_source] if from_source else None,
            eval_dataset=str(eval_dir) if eval_dir else None,
            min_ndcg=min_ndcg,
            eval_split=eval_split,
            include=include,
            exclude=exclude,
            allow_mass_delete=allow_mass_delete,
            force=force,
            encoding=encoding,
        )

    def human() -> None:
        typer.echo(
            f"{report['alias']}: {report['previous'] or '(new)'} -> {report['collection']} "
            f"({report['documents']} documents, {report['points']} points, "
            f"{report['model']['model_id']})"
        )
        for failure in report["failures"]:
            typer.echo(f"  failed: {failure['uri']}: {failure['error']}")

    _emit(as_json, report, human)


@app.command()
def rollback(
    collection: CollectionOption = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="COLLECTION",
            help="Point the alias at this collection of its own instead (one `quarry "
            "collections` lists, not an unfinished build): undoes a rollback.",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Point the alias back at the collection it served before the last reindex.

    With --to, point it at another of its collections instead (undoing a rollback).
    """
    settings = _settings(collection=collection)
    with _errors_to_exit_codes():
        from flows import configure_prefect_environment

        # The writers' Prefect (and so their concurrency limit), not ~/.prefect's.
        configure_prefect_environment(settings.data_dir)
        from flows.ingest import one_writer
        from quarry.reindex import rollback as roll_back
        from quarry.store import VectorStore, open_client

        with one_writer(settings, settings.collection, wait=False):
            store = VectorStore(open_client(settings), settings.collection)
            try:
                current, previous = roll_back(store, to)
                built_by = store.fingerprint(previous)
            finally:
                store.close()
    data: dict[str, Any] = {"alias": settings.collection, "from": current, "to": previous}
    if built_by is not None:
        data["model"] = {"model_id": built_by.model.model_id, "model_key": built_by.model_key}

    def human() -> None:
        if current == previous:  # --to the collection already served: idempotent
            typer.echo(f"{settings.collection}: already serves {current}; nothing changed")
        else:
            typer.echo(f"{settings.collection}: {current} -> {previous}")
        if built_by is not None:  # queries and ingests are refused until it is served
            typer.echo(f"  built by {built_by.model.describe()}: serve that model for it")

    _emit(as_json, data, human)


@app.command()
def prune(
    collection: CollectionOption = None,
    keep: Annotated[
        int,
        typer.Option(
            min=1,
            metavar="N",
            help="Collections to keep: the live one, the rollback target, the newest.",
        ),
    ] = 2,
    as_json: JsonFlag = False,
) -> None:
    """Delete old physical collections of the alias, keeping --keep N of them.

    Kept first: the live one, then the one `quarry rollback` returns to, then the newest.
    """
    settings = _settings(collection=collection)
    with _errors_to_exit_codes():
        from flows import configure_prefect_environment

        # The writers' Prefect (and so their concurrency limit), not ~/.prefect's.
        configure_prefect_environment(settings.data_dir)
        from flows.ingest import one_writer
        from quarry.reindex import prune as prune_collections
        from quarry.store import VectorStore, open_client

        # A running reindex's build looks unfinished: prune must not run beside it.
        with one_writer(settings, settings.collection, wait=False):
            store = VectorStore(open_client(settings), settings.collection)
            try:
                dropped = prune_collections(store, keep)
            finally:
                store.close()

    def human() -> None:
        typer.echo(f"deleted {len(dropped)} collections" + "".join(f"\n  {n}" for n in dropped))

    _emit(as_json, {"alias": settings.collection, "deleted": dropped}, human)


@app.command()
def parity(
    candidate_embed_url: Annotated[
        str, typer.Option(metavar="URL", help="The embedding service to compare with the live one.")
    ],
    candidate_rerank_url: Annotated[
        str | None, typer.Option(metavar="URL", help="A reranker to compare with the live one.")
    ] = None,
    collection: CollectionOption = None,
    sample: Annotated[
        int, typer.Option(min=1, metavar="N", help="Stored passages to re-embed.")
    ] = 200,
    accept: Annotated[
        bool, typer.Option("--accept", help="Record a passing result: allow that serving stack.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Measure whether a candidate service embeds (and reranks) like the one that built the index.

    Exits 1 when parity is not reached (3 when --accept is refused).
    """
    settings = _settings(collection=collection)
    for flag, url in (
        ("--candidate-embed-url", candidate_embed_url),
        ("--candidate-rerank-url", candidate_rerank_url),
    ):
        try:
            if url is not None:
                http_url(url)
        except ValueError as error:
            _fail(f"{flag}: {error}", EXIT_USAGE)
    with _errors_to_exit_codes():
        from quarry.parity import accept as record
        from quarry.parity import measure_parity
        from quarry.services import embedding_client, open_services, rerank_client

        with ExitStack() as stack:
            services = stack.enter_context(open_services(settings))
            # The candidates take the live services' keys: a stack that gates its
            # TEI with --api-key gives the next engine the same one.
            candidate = embedding_client(settings, candidate_embed_url)
            stack.callback(candidate.close)
            candidate_reranker = None
            if candidate_rerank_url:
                candidate_reranker = rerank_client(settings, candidate_rerank_url)
                stack.callback(candidate_reranker.close)
            report = measure_parity(
                services.store,
                services.embedder,
                candidate,
                sample=sample,
                live_reranker=services.reranker if candidate_reranker else None,
                candidate_reranker=candidate_reranker,
                rerank_threshold=settings.rerank_threshold,
                min_cosine=settings.parity_min_cosine,
                min_overlap=settings.parity_min_overlap,
            )
            if accept:
                record(services.store, report)

    def human() -> None:
        typer.echo(
            f"sample {report.sample}: cosine median {report.cosine_median:.6f}, "
            f"min {report.cosine_min:.6f}; overlap@10 {report.overlap_at_10:.3f} over "
            f"{report.queries} queries"
        )
        if report.rerank:
            typer.echo(
                f"rerank: top-1 agreement {report.rerank['top1_agreement']:.2f}, top-3 "
                f"{report.rerank['top3_agreement']:.2f}, "
                f"{report.rerank['threshold_crossings']} scores cross the threshold"
            )
        verdict = "passes" if report.passed else "does NOT pass"
        typer.echo(f"parity {verdict}" + (" and is recorded" if report.accepted else ""))

    _emit(as_json, report.to_dict(), human, EXIT_OK if report.passed else EXIT_FAILED)
    if not report.passed:
        raise typer.Exit(EXIT_FAILED)


@app.command("eval")
def evaluate(
    dataset_dir: Annotated[
        Path, typer.Argument(metavar="DATASET_DIR", help="A BEIR-layout dataset folder.")
    ],
    split: Annotated[
        str, typer.Option(metavar="SPLIT", help="Which qrels/<split>.tsv to score.")
    ] = "test",
    no_rerank: Annotated[bool, typer.Option("--no-rerank", help="Vector scores only.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Score retrieval on a BEIR dataset: nDCG@10, recall@10, recall@100, MRR@10."""
    settings = _settings()
    if not dataset_dir.is_dir():
        _fail(f"{dataset_dir}: no such directory", EXIT_USAGE)
    with _errors_to_exit_codes():
        from quarry.evaluate import eval_command

        eval_command(
            dataset_dir, settings=settings, split=split, rerank=not no_rerank, as_json=as_json
        )


@app.command()
def api(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=1, max=65535, metavar="PORT", help="Port to listen on.")
    ] = 8000,
) -> None:
    """Serve the query API for applications: POST /v1/query, GET /v1/collections.

    Also GET /healthz (alive) and /readyz (its services reachable, the model right).
    """
    settings = _settings()
    with _errors_to_exit_codes():
        from quarry.api import serve as serve_api

        serve_api(settings, host=host, port=port)


@app.command(
    "local-tei",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def local_tei(ctx: typer.Context) -> None:
    """Serve TEI's HTTP API locally (the embedded default's model, or a hash stand-in).

    Takes the options of ``python -m quarry.local_tei``; ``--help`` lists them. Its
    port is 8001 unless ``--port`` says otherwise (the module's picks a free one).
    """
    from quarry.local_tei.__main__ import main as serve_local_tei

    serve_local_tei(ctx.args, prog="quarry local-tei", port=8001)


def _summaries_in_full() -> None:
    """List each command in ``quarry --help`` by its docstring's whole first paragraph.

    Plain help otherwise cuts a summary to fit the terminal's width, mid-sentence.
    """
    for command in app.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if command.short_help is None and doc:
            command.short_help = " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())


_summaries_in_full()


def _run_for_json() -> int:
    """Run the app so that the option parser's usage errors reach stdout as JSON too.

    In standalone mode typer prints those itself and exits; without it they are
    raised here, as ``typer.TyperException`` (click's exceptions in typer's copy).
    """
    try:
        result = app(standalone_mode=False)
    except typer.TyperException as error:
        message = error.format_message()
        typer.echo(f"quarry: error: {message}", err=True)
        _echo_json_error(message, error.exit_code)
        return error.exit_code
    except typer.Abort:
        typer.echo("quarry: error: aborted", err=True)
        _echo_json_error("aborted", EXIT_FAILED)
        return EXIT_FAILED
    return result if isinstance(result, int) else EXIT_OK


def _run() -> int:
    """Run the app in standalone mode (click prints usage errors itself); its exit code."""
    try:
        app()
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or EXIT_OK
        typer.echo(code, err=True)
        return EXIT_FAILED
    return EXIT_OK


def _exit(code: int) -> NoReturn:
    """Exit with ``code``, the command's outcome, which is said and flushed by now.

    What follows (atexit handlers, closing connections, freeing modules) takes up to
    a second; a Ctrl-C then ends the process at once with that same code, rather than
    turning a finished command into "interrupted" (130) after its result was printed.
    """
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed pipe: nothing more can be said
            stream.flush()
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda _signum, _frame: os._exit(code))
    sys.exit(code)


def _ignore_stop_signals() -> None:
    """The last atexit handler (registered first): Python's finalization, which follows,
    gives SIGINT back its default, and a Ctrl-C then killed a finished command by the
    signal (status 130, the success JSON printed). An ignored signal stays ignored."""
    for stop in (signal.SIGINT, signal.SIGTERM):
        with suppress(ValueError):  # not the main thread: nothing to do
            signal.signal(stop, signal.SIG_IGN)


atexit.register(_ignore_stop_signals)


def main() -> None:
    """Console-script entry point."""
    global _json_errors
    arguments = sys.argv[1:]
    if arguments[:1] == ["--json"] and len(arguments) > 1 and not arguments[1].startswith("-"):
        # `quarry --json status`: the flag is the command's, wherever it is written.
        arguments = [arguments[1], "--json", *arguments[2:]]
        sys.argv[1:] = arguments
    options = arguments[: arguments.index("--")] if "--" in arguments else arguments
    _json_errors = any(a == "--json" or a.startswith("--json=") for a in options)
    try:
        code = _run_for_json() if _json_errors else _run()
    except KeyboardInterrupt:  # between two commands' own handlers, or in typer's parsing
        code = 130
    if code == 130 and _emitted_code is not None:
        code = _emitted_code  # the result was printed: the Ctrl-C came after the work
    elif code == 130 and not (_failure_reported or _stop_reported):
        # typer turns a Ctrl-C outside a command's error handling (while a command
        # imports what it needs, say) into a silent exit 130: say what happened.
        typer.echo("quarry: error: interrupted", err=True)
        if _json_errors:
            _echo_json_error("interrupted", 130)
    _exit(code)
