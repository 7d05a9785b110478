"""quarry's exception tree.

Every error quarry raises on purpose derives from :class:`QuarryError` and names
the document, chunk, URL or collection it is about, so a failure in a long run
can be traced to its cause without a debugger::

    QuarryError
    ├── ConfigError                 a setting is missing or contradictory
    ├── SourceError                 a source path or file (has ``uri``)
    │   ├── SourceNotFound          a source root does not exist
    │   └── UnreadableDocument      binary, too large, undecodable, broken
    ├── ServiceError                an HTTP service (has ``url``)
    │   ├── ServiceUnavailable      retries spent on 429/503/424/connection errors
    │   ├── RequestRejected         the service said the request is wrong (400/413/422)
    │   │   ├── InputTooLong        an input over the model's max_input_length
    │   │   │   └── QueryTooLong    the query itself is too long (model or reranker)
    │   │   └── DialectMismatch     the service speaks another API dialect
    │   └── BadResponse             the service answered something unparseable
    │       └── VectorsOfAnotherSize  vectors not of the index's size (another model?)
    ├── StoreError                  Qdrant (has ``collection``)
    │   ├── StoreLocked             another quarry process holds the index or its writers' slot
    │   └── WriteFailed             an upsert or delete was not acknowledged
    │       └── StoreUnavailable    Qdrant took no write at all (unreachable, disk full)
    ├── IngestIncomplete            a run that asked to fail on failures had some: exit 4
    └── Refused                     quarry will not do this: CLI exit 3, API 409
        ├── FingerprintMismatch     index made by another model
        ├── ServingChanged          same model, other engine; no parity recorded
        ├── CanaryMismatch          the canary no longer embeds the same way
        └── MassDeleteRefused       a sync would delete too much of a source
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class QuarryError(Exception):
    """Base of every error quarry raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Prefect may store a failed task's exception and load it again; the subclasses'
        # own __init__ arguments (url, collection, message) are not in ``args``.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[QuarryError], args: tuple[Any, ...], state: dict[str, Any]) -> QuarryError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ConfigError(QuarryError):
    """A setting is missing, malformed or contradicts another."""


class SourceError(QuarryError):
    """A problem with a source root or a file under it."""

    def __init__(self, uri: str, message: str) -> None:
        self.uri = uri
        self.reason = message
        super().__init__(f"{uri}: {message}")


class SourceNotFound(SourceError):
    """A source path given to ingest does not exist (or has a name quarry cannot use)."""


class UnreadableDocument(SourceError):
    """A file that cannot be turned into text: binary, too large, undecodable or broken."""


class ServiceError(QuarryError):
    """An HTTP service (embedding, rerank) failed; ``url`` names the endpoint."""

    def __init__(
        self,
        url: str,
        message: str,
        *,
        status: int | None = None,
        documents: Sequence[str] = (),
    ) -> None:
        self.url = url
        self.reason = message  # without the url
        self.status = status
        self.documents = tuple(dict.fromkeys(documents))  # one per document, not per chunk
        text = f"{url}: {message}"
        if self.documents:
            shown = ", ".join(self.documents[:5])
            more = f" and {len(self.documents) - 5} more" if len(self.documents) > 5 else ""
            text += f" (documents: {shown}{more})"
        super().__init__(text)


class ServiceUnavailable(ServiceError):
    """Transient failures (429, 503, 424, connection errors) outlasted the retry budget."""


class RequestRejected(ServiceError):
    """The service rejected the request as wrong (400, 413, 422); retrying as-is cannot help."""


class InputTooLong(RequestRejected):
    """An input is over the model's ``max_input_length``; it must be split, never truncated."""


class QueryTooLong(InputTooLong):
    """The query itself is too long: for the embedding model, or for a reranker on its
    own (no passage fits beside it, however split). The question's fault, not a
    passage's or the service's."""


class DialectMismatch(RequestRejected):
    """The service speaks another API dialect than the one quarry used."""


class BadResponse(ServiceError):
    """The service answered with something that is not what its API promises."""


class VectorsOfAnotherSize(BadResponse):
    """Passage vectors not of the size the index takes: a fault, or another model
    behind the same URL (an ingest then judges the model again, and refuses it)."""


class StoreError(QuarryError):
    """A Qdrant operation failed; ``collection`` names the collection."""

    def __init__(self, collection: str, message: str) -> None:
        self.collection = collection
        super().__init__(f"collection {collection!r}: {message}")


class StoreLocked(StoreError):
    """Another quarry process holds what this one needs.

    Local-mode Qdrant admits one process at a time, so the whole folder is held,
    whatever the collection: the message names the folder. ``prune`` and
    ``rollback`` also refuse while an ingest or reindex holds the writers' slot.
    """

    def __init__(self, collection: str, message: str) -> None:
        self.collection = collection
        QuarryError.__init__(self, message)  # not "collection 'x': ...": all are held


class WriteFailed(StoreError):
    """An upsert or delete was not acknowledged as completed."""


class StoreUnavailable(WriteFailed):
    """Qdrant could not take a write at all: unreachable, timed out, failing (5xx), or
    its disk full or unwritable. Not the written documents' fault: a run stops."""


class IngestIncomplete(QuarryError):
    """An ingest finished, but some documents could not be indexed, and the run was asked
    to fail for that (``fail_on_failures``): its ``summary`` is the finished run's."""

    def __init__(self, collection: str, summary: Mapping[str, Any]) -> None:
        self.collection = collection
        self.summary = dict(summary)
        failures = self.summary.get("failures") or []
        first = f"; first: {failures[0]['uri']}: {failures[0]['error']}" if failures else ""
        super().__init__(
            f"ingest of {collection!r}: {self.summary.get('documents_failed', 0)} documents "
            f"could not be indexed (fail on failures){first}"
        )

    def __reduce__(self) -> tuple[type[IngestIncomplete], tuple[str, dict[str, Any]]]:
        # Prefect may store a failed run's exception and load it again: keep the summary.
        return type(self), (self.collection, self.summary)


class Refused(QuarryError):
    """quarry refuses to go on because the result would be wrong or destructive (exit 3)."""


class FingerprintMismatch(Refused):
    """The index was built by another model than the live embedding service serves."""


class ServingChanged(Refused):
    """Same model, different engine/version/dtype, and no accepted parity measurement."""


class CanaryMismatch(Refused):
    """The canary text no longer embeds to the vector stored with the index."""


class MassDeleteRefused(Refused):
    """A full sync would delete more of a source than ``QUARRY_MAX_DELETE_FRACTION``."""
