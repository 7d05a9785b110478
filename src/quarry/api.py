"""The query API for applications: FastAPI, async end to end.

``create_app(settings)`` builds the app; its lifespan builds the clients from
Settings once (``AsyncOpenAI`` for embeddings, ``httpx2`` for rerank,
``AsyncQdrantClient`` for a Qdrant server, local mode on a thread of its own)
and closes them on shutdown. With no
``QUARRY_EMBED_URL`` it starts :mod:`quarry.local_tei` in-process, as the CLI does.
``serve(settings, host, port)`` runs it under uvicorn, and refuses a non-loopback
address without an API key unless ``QUARRY_API_AUTH=disabled``.

Routes: ``POST /v1/query``, ``GET /v1/collections`` (both behind
``Authorization: Bearer <QUARRY_API_KEY>`` when a key is set), ``GET /healthz``
(alive) and ``GET /readyz`` (dependencies reachable, fingerprint compatible).

The query path is :mod:`quarry.search`'s: the same filter, result building,
threshold and collapse. The index's fingerprint is checked against the live
embedding service at startup, on every ``/readyz``, every
``QUARRY_FINGERPRINT_RECHECK_SECONDS`` while queries come in, and at once when a
search meets points of another model (the alias moved): a mismatch answers 409
naming both models, never results.

Every non-2xx answer has one shape, ``{"error": {"type", "message",
"request_id", ...}}``, and every response an ``X-Request-ID`` header (the
caller's, when it sends a sane one), which the log lines carry too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import hmac
import ipaddress
import logging
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import (
    AbstractContextManager,
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from contextvars import Context, ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import uvicorn
from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from qdrant_client import models
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quarry import __version__
from quarry._async_clients import (
    AsyncEmbeddingClient,
    AsyncRerankClient,
    AsyncStore,
    open_async_qdrant,
    stored_fingerprint,
)
from quarry._http import RetryPolicy, TransientFailure, says_down
from quarry.config import Settings
from quarry.errors import (
    BadResponse,
    CanaryMismatch,
    ConfigError,
    FingerprintMismatch,
    InputTooLong,
    QuarryError,
    QueryTooLong,
    Refused,
    ServiceError,
    ServiceUnavailable,
    ServingChanged,
)
from quarry.fingerprint import Fingerprint
from quarry.search import (
    Collapse,
    RerankOutcome,
    SearchFilter,
    is_blank_query,
    model_summary,
    query_task_warning,
    rank_results,
    rerank_fallback_warning,
    rerank_texts,
    score_threshold,
    verify_fingerprint,
)
from quarry.services import (
    async_embedding_client,
    async_rerank_client,
    retry_policy,
    start_local_tei_if_needed,
)
from quarry.store import not_an_alias

__all__ = ["check_bind_address", "create_app", "serve"]

logger = logging.getLogger("quarry.api")

T = TypeVar("T")

REQUEST_ID_HEADER = "X-Request-ID"
# An incoming request id is echoed only when it is short and plain (it goes into logs).
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_current_request_id: ContextVar[str] = ContextVar("quarry_request_id", default="-")
# When the calls of the query being answered must have answered (the event loop's
# clock), or None: no limit (readiness probes have their own).
_answer_by: ContextVar[float | None] = ContextVar("quarry_answer_by", default=None)

MAX_QUERY_CHARS = 65_536
"""A hard cap on the query text, before any token counting (even with ``truncate``)."""
READY_TIMEOUT_S = 5.0
"""How long ``/readyz`` waits for each dependency it needs."""
READY_OPTIONAL_TIMEOUT_S = 1.0
"""How long ``/readyz`` waits for a reranker that readiness does not count (not
QUARRY_RERANK_REQUIRED): a hung one must not make the probe itself time out."""
_PROBE = RetryPolicy(
    budget=0.0, initial=0.0, maximum=0.0, jitter=0.0, info_timeout_s=READY_TIMEOUT_S
)
"""One attempt, no retry: for readiness probes and rechecks, which must answer fast, but
give a slow ``/info`` the READY_TIMEOUT_S that ``/readyz`` promises (their callers' own
deadlines cap it)."""
RERANK_COOLDOWN_S = 10.0
"""How long queries answer from vector scores without asking a reranker that failed."""
QUERY_RERANK_RETRY_S = 2.0
"""The most a query waits on a failing reranker before it falls back (or, required, fails)."""
EMBED_COOLDOWN_S = 5.0
"""How long queries get their 503 at once, without asking an embedding service that failed."""
QUERY_EMBED_RETRY_S = 5.0
"""The most a query waits on a failing embedding service before its 503 (a service
restarting takes seconds; a client's timeout is often 30 s)."""
_RERANK_WARNING = '199 quarry "rerank failed; answered from vector scores"'
_EMBEDDING, _RERANKER, _QDRANT = "embedding service", "reranker", "qdrant"
_RETRY_AFTER_S = {_EMBEDDING: EMBED_COOLDOWN_S, _RERANKER: RERANK_COOLDOWN_S}


# -- request and response bodies --------------------------------------------------------------

MetadataKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
_INT64 = (-(2**63), 2**63 - 1)


def _metadata_value(value: object) -> str | bool | int:
    """One error for a value of none of the three kinds, not one per kind it is not."""
    if isinstance(value, bool) or (isinstance(value, str) and len(value) <= 1024):
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON Schema's integer: 2.0 is one
    if isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
        return value
    raise PydanticCustomError(
        "metadata_value",
        "must be a string of up to 1,024 characters, a 64-bit integer or a boolean",
    )


MetadataValue = Annotated[
    str | bool | int,
    PlainValidator(_metadata_value),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "maxLength": 1024},
                {"type": "boolean"},
                {"type": "integer", "minimum": _INT64[0], "maximum": _INT64[1]},
            ]
        }
    ),
]
DocId = Annotated[str, StringConstraints(min_length=1, max_length=256)]


_MAX_UNKNOWN_FIELDS = 8
LOCAL_MODE_MAX_DOC_IDS = 100
MAX_METADATA_CONDITIONS = 32


class _ClosedBody(BaseModel):
    """A request object with a fixed set of fields, each of its own type (strict)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: object) -> object:
        # Pydantic reports each unknown field on its own, after validating the rest:
        # 60,000 of them made a 5 MB answer and held the event loop for most of a second.
        if not isinstance(data, dict):
            return data
        unknown = [key for key in data if key not in cls.model_fields]
        if len(unknown) > _MAX_UNKNOWN_FIELDS:
            raise PydanticCustomError(
                "extra_forbidden",
                "{count} unknown fields, such as {sample}",
                {"count": len(unknown), "sample": ", ".join(map(repr, unknown[:5]))},
            )
        return data


class QueryFilter(_ClosedBody):
    """Restrict the candidates; every given condition must hold."""

    uri_prefix: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description=(
            "A document uri, a file (every page of a PDF), or a folder of them, e.g. `docs/guides`."
        ),
    )
    doc_ids: list[DocId] | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="Only these documents: up to 1,000 with a Qdrant server, 100 with "
        "local-mode Qdrant (which tests every point against every id; a 422 says so).",
    )
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        None,
        max_length=MAX_METADATA_CONDITIONS,
        description="Exact matches on document metadata (string, integer or boolean values).",
    )

    @field_validator("metadata", mode="before")
    @classmethod
    def _few_conditions(cls, value: object) -> object:
        # Counted before each key and value is validated (and reported on its own).
        if isinstance(value, dict) and len(value) > MAX_METADATA_CONDITIONS:
            raise PydanticCustomError(
                "too_long",
                "at most {limit} metadata conditions, not {count}",
                {"limit": MAX_METADATA_CONDITIONS, "count": len(value)},
            )
        return value


_QUERY_EXAMPLE: dict[str, Any] = {
    "query": "How do I rotate the API keys?",
    "top_k": 5,
    "filter": {"uri_prefix": "docs/operations.md"},
}


class QueryRequest(_ClosedBody):
    """A question and how to answer it."""

    model_config = ConfigDict(json_schema_extra={"examples": [_QUERY_EXAMPLE]})

    query: str = Field(
        min_length=1,
        max_length=MAX_QUERY_CHARS,
        description="The question: not blank, at most QUARRY_MAX_QUERY_TOKENS tokens "
        "unless `truncate`.",
    )
    top_k: int = Field(10, ge=1, le=100, description="Passages to return.")
    candidates: int = Field(
        50,
        ge=1,
        le=1000,
        description="Vector candidates fetched before reranking (at least `top_k`).",
    )
    filter: QueryFilter | None = None
    rerank: bool = Field(True, description="Rerank the candidates (else vector scores only).")
    threshold: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Drop results scoring under this. Default for reranked answers: "
        "QUARRY_RERANK_THRESHOLD; answers with `rerank` false are cut only when this is "
        "given, and one that fell back to vector scores after a failed rerank is not cut.",
    )
    collapse: Collapse = Field(
        "none",
        description="`doc`: keep each document's best passage among the candidates "
        "(fewer than `top_k` results when the candidates hold fewer documents).",
    )
    truncate: bool = Field(
        False,
        description="Cut a query over the token limit instead of refusing it; the answer "
        "then says `truncated: true`.",
    )

    # JSON Schema's "integer" is any number with no fraction: 10.0 is one (a client
    # that does its arithmetic in floats sends it), 10.5 and "10" are not.
    @field_validator("top_k", "candidates", mode="before")
    @classmethod
    def _integral(cls, value: object) -> object:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    # Not a schema `pattern`: generating long strings that match one is very slow for
    # schema-driven fuzzers, and the rule is simple.
    @field_validator("query")
    @classmethod
    def _not_blank(cls, query: str) -> str:
        if is_blank_query(query):
            raise ValueError("must contain something other than whitespace")
        return query


class Passage(BaseModel):
    """One passage of an answer, best first."""

    text: str
    score: float = Field(description="The rerank score when reranked, else the vector score.")
    vector_score: float
    rerank_score: float | None
    doc_id: str
    uri: str
    chunk_index: int
    headings: list[str]
    title: str
    metadata: dict[str, Any]


class ModelRef(BaseModel):
    """The model that built the index (and embedded the query)."""

    model_id: str
    model_key: str


class QueryResponse(BaseModel):
    """The answer to one query."""

    results: list[Passage]
    model: ModelRef
    reranked: bool = Field(
        description="False when rerank was off, no candidate matched (nothing to rerank; "
        "no warning about it), or the reranker was down (a warning says so)."
    )
    truncated: bool = Field(description="True when the query was cut to fit (`truncate`).")
    warnings: list[str]
    timings_ms: dict[str, float]


class ErrorInfo(BaseModel):
    """What went wrong."""

    type: str = Field(description="A stable machine-readable kind, e.g. `invalid_request`.")
    message: str
    request_id: str
    dependency: str | None = Field(
        None, description="For 503s and 504s: the dependency that failed or did not answer."
    )
    details: list[dict[str, Any]] | None = Field(None, description="Per-field validation errors.")


class ErrorBody(BaseModel):
    """The one shape of every non-2xx answer."""

    error: ErrorInfo


class Check(BaseModel):
    """One readiness check."""

    ok: bool
    detail: str
    required: bool = Field(
        True,
        description="Whether readiness depends on it: the reranker only with "
        "QUARRY_RERANK_REQUIRED (otherwise queries answer from vector scores without it).",
    )


class ReadyBody(BaseModel):
    """Everything the API needs answers (an optional reranker may be down: see its check)."""

    status: Literal["ready"]
    checks: dict[str, Check]


class NotReadyBody(ErrorBody):
    """Something the API needs does not answer, or the index does not match the model."""

    checks: dict[str, Check]


class Health(BaseModel):
    """The process is alive."""

    status: Literal["ok"]


class CollectionEntry(BaseModel):
    """A physical collection of the alias."""

    name: str
    aliases: list[str]
    active: bool = Field(description="The alias points at it: queries read it.")
    points: int
    model: ModelRef | None
    created_at: str | None


class CollectionList(BaseModel):
    """The physical collections behind the configured alias, newest first."""

    alias: str
    collections: list[CollectionEntry]


# -- errors -----------------------------------------------------------------------------------


class ApiError(Exception):
    """An answer other than 2xx, in the one error shape."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        dependency: str | None = None,
        headers: Mapping[str, str] | None = None,
        details: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.dependency = dependency
        self.headers = dict(headers or {})
        self.details = details  # pydantic's {"loc", "msg", "type"}, as other 422s have


class _CoolingDown(ServiceUnavailable):
    """A dependency in its cooldown: not asked, and asked again in ``retry_after_s``."""

    def __init__(self, url: str, message: str, *, status: int | None, retry_after_s: float):
        super().__init__(url, message, status=status)
        self.retry_after_s = retry_after_s


class _NoAnswer(ServiceUnavailable):
    """A dependency had not answered when the query's time (QUARRY_QUERY_TIMEOUT) ran out."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, message)
        self.reason = message  # for the client: without the url (which may be "")


def _dependency_down(dependency: str, error: BaseException) -> ApiError:
    reason = error.reason if isinstance(error, _NoAnswer) else _reason(error)
    logger.warning(
        "request_id=%s %s failed: %s", _current_request_id.get(), dependency, str(error) or reason
    )
    if isinstance(error, _NoAnswer):
        return ApiError(
            504,
            "dependency_timeout",
            f"{dependency} did not answer: {reason}",
            dependency=dependency,
        )
    # When asking again can help: an embedding service or a reranker that is down is
    # not asked for its cooldown, so a sooner retry gets the same 503 at once. Busy (429)
    # or failing on one input (500), it is asked by the next query.
    if isinstance(error, _CoolingDown):
        retry_after = error.retry_after_s
    elif isinstance(error, ServiceUnavailable) and says_down(error):
        retry_after = _RETRY_AFTER_S.get(dependency, 1.0)
    else:
        retry_after = 1.0
    return ApiError(
        503,
        "dependency_unavailable",
        f"{dependency} unavailable: {reason}",
        dependency=dependency,
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
    )


@contextmanager
def _answer_within(seconds: float) -> Iterator[None]:
    """Give the dependency calls made in the block ``seconds`` in all (``QueryService._call``)."""
    token = _answer_by.set(asyncio.get_running_loop().time() + seconds)
    try:
        yield
    finally:
        _answer_by.reset(token)


def _reason(error: BaseException) -> str:
    """An error's message for a client: without the internal service URLs in it (the
    server's log has them), wherever a wrapped error put them."""
    text = str(error) or type(error).__name__
    text = _URL_LEAD.sub("", text)
    return _URL.sub("<service URL>", text)[:500]


# "http://host:port/path: " as service errors start (also inside a wrapping error's text).
_URL_LEAD = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+?: ")
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s)'\"]+")


_REFUSAL_KIND: dict[type[Refused], str] = {
    FingerprintMismatch: "fingerprint_mismatch",
    ServingChanged: "serving_changed",
    CanaryMismatch: "canary_mismatch",
}


def _refusal(error: Refused) -> ApiError:
    return ApiError(409, _REFUSAL_KIND.get(type(error), "refused"), str(error))


def error_body(
    status: int,
    kind: str,
    message: str,
    request_id: str,
    *,
    dependency: str | None = None,
    details: Sequence[Mapping[str, Any]] | None = None,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> JSONResponse:
    """A response in the one error shape."""
    info: dict[str, Any] = {"type": kind, "message": message, "request_id": request_id}
    if dependency is not None:
        info["dependency"] = dependency
    if details is not None:
        info["details"] = list(details)
    return JSONResponse({"error": info, **(extra or {})}, status_code=status, headers=headers)


def _request_id(request: Request) -> str:
    return str(request.scope.get("quarry.request_id") or _current_request_id.get())


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_body(
        exc.status,
        exc.kind,
        exc.message,
        _request_id(request),
        dependency=exc.dependency,
        details=exc.details,
        headers=exc.headers,
    )


_MAX_ERROR_DETAILS = 20


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    details = [
        {
            "loc": [str(part) for part in error.get("loc", ())],
            "msg": str(error.get("msg", "")),
            "type": str(error.get("type", "")),
        }
        for error in errors[:_MAX_ERROR_DETAILS]
    ]
    if len(errors) > _MAX_ERROR_DETAILS:
        # One body with thousands of bad keys must not get an answer many times its size.
        details.append(
            {
                "loc": [],
                "msg": f"{len(errors) - _MAX_ERROR_DETAILS} more errors not listed",
                "type": "too_many_errors",
            }
        )
    first = details[0] if details else {"loc": [], "msg": "invalid request"}
    where = ".".join(part for part in first["loc"] if part != "body") or "body"
    message = f"{where}: {first['msg']}"
    if first.get("type") == "json_invalid":  # its loc holds a character offset, not a field
        at = first["loc"][-1] if len(first["loc"]) > 1 else "?"
        reason = str((errors[0].get("ctx") or {}).get("error") or "JSON decode error")
        message = f"body: not valid JSON at character {at}: {reason}"
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if where == "body" and media_type != "application/json":
        # FastAPI reads a body sent as another type (curl -d's form type) as no JSON at all.
        message += (
            f"; send it as JSON, with Content-Type: application/json (not {media_type or 'none'})"
        )
    return error_body(
        422,
        "invalid_request",
        message,
        _request_id(request),
        details=details,
    )


_HTTP_KINDS = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
}


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:
        # FastAPI's answer to a body it cannot even decode: bad input, so 422, saying why.
        msg, kind = _undecodable(exc.__cause__)
        return error_body(
            422,
            "invalid_request",
            f"body: {msg}",
            _request_id(request),
            details=[{"loc": ["body"], "msg": msg, "type": kind}],
        )
    return error_body(
        exc.status_code,
        _HTTP_KINDS.get(exc.status_code, "http_error"),
        str(exc.detail),
        _request_id(request),
        headers=exc.headers,
    )


def _undecodable(cause: BaseException | None) -> tuple[str, str]:
    """(message, type) for a body FastAPI could not read as JSON at all."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start : cause.start + 1].hex()
        return f"not UTF-8 (byte 0x{byte} at position {cause.start}); send JSON in UTF-8", "utf8"
    if isinstance(cause, RecursionError):
        return "JSON nested too deeply to read", "json_too_deep"
    return "cannot be read as JSON", "json_invalid"


async def _on_quarry_error(request: Request, exc: Exception) -> Response:
    # A safety net: the routes map quarry's errors themselves, naming the dependency.
    assert isinstance(exc, QuarryError)
    if isinstance(exc, Refused):
        mapped = _refusal(exc)
    else:
        mapped = ApiError(503, "dependency_unavailable", _reason(exc))
    return await _on_api_error(request, mapped)


# -- request ids, logging, last-resort errors -------------------------------------------------


class RequestContext:
    """Pure ASGI middleware: request id, one log line per request, no stack trace ever sent.

    Also turns a failed startup caused by a QuarryError (a locked local-mode Qdrant)
    into one clear line for the server's log instead of a traceback.
    """

    def __init__(self, app: ASGIApp, *, owner: FastAPI) -> None:
        self.app = app
        self.owner = owner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection."""
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope) or uuid.uuid4().hex
        scope["quarry.request_id"] = request_id
        token = _current_request_id.set(request_id)
        started = time.perf_counter()
        status = 0
        settings: Settings = self.owner.state.settings
        refusal = _refuse_early(scope, settings, request_id)
        watch = None
        if refusal is None:
            watch = _DisconnectWatch(_limited(receive, settings.api_max_body_bytes))
            receive = watch.receive

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                if watch is not None:
                    watch.answering()
                status = int(message["status"])
                headers = MutableHeaders(scope=message)
                headers.append(REQUEST_ID_HEADER, request_id)
                # Time in the server from the request's arrival to this response
                # (https://www.w3.org/TR/server-timing/): what a client sees beyond it
                # is its own HTTP stack and the network.
                elapsed = (time.perf_counter() - started) * 1000
                headers.append("Server-Timing", f"app;dur={elapsed:.2f}")
            await send(message)

        try:
            if refusal is not None:
                await refusal(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            if watch is None or not watch.cancelled_request():
                raise
            status = _CLIENT_CLOSED  # nginx's code for it: the log says what happened
        except Exception:
            logger.exception("request_id=%s unhandled error", request_id)
            if status:
                raise
            response = error_body(
                500,
                "internal_error",
                f"internal error; the server log has the details under request id {request_id}",
                request_id,
            )
            await response(scope, receive, send_with_id)
        finally:
            path = scope.get("raw_path") or scope["path"].encode()
            logger.info(
                "request_id=%s %s %s %d %.1fms",
                request_id,
                scope["method"],
                path.decode("latin-1"),
                status,
                (time.perf_counter() - started) * 1000,
            )
            _current_request_id.reset(token)
            if watch is not None:
                watch.close()

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            error = getattr(self.owner.state, "startup_error", None)
            if message["type"] == "lifespan.startup.failed" and isinstance(error, QuarryError):
                message = {**message, "message": f"quarry api cannot start: {error}"}
            await send(message)

        return lifespan_send


_CLIENT_CLOSED = 499


# A request answered within this long is not watched: a watching task per request
# costs more than the little work that a client gone so soon leaves running.
_WATCH_AFTER_S = 0.05


class _DisconnectWatch:
    """Cancels a request whose client goes away before it is answered.

    Once the body is in (and the request has run for ``_WATCH_AFTER_S``), a watcher
    waits for the server's ``http.disconnect``: arriving before the answer has
    started, it cancels the request's task, so the embedding service and the
    reranker are not kept busy for a caller that left (a client that gave up and
    retries would otherwise add to the load each time). After the answer the server
    sends the same message: nothing is cancelled then.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._gone = asyncio.Event()
        self._answered = False
        self._cancelled = False
        self._closed = False

    async def receive(self) -> Message:
        """The server's ``receive``; after the body, what the watcher saw."""
        if self._task is not None:
            if self._answered and self._watcher is None:
                return await self._receive()  # nothing watches: the server's own answer
            self._start_watching()
            await self._gone.wait()
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self._task = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(
                _WATCH_AFTER_S, self._start_watching
            )
        return message

    def answering(self) -> None:
        """The answer has started: a disconnect from now on cancels nothing."""
        self._answered = True

    def cancelled_request(self) -> bool:
        """Whether a cancellation of the request came from this watch alone; takes it
        back (one the server also asked for, at shutdown, stands)."""
        if self._cancelled and self._task is not None:
            return self._task.uncancel() == 0
        return False

    def close(self) -> None:
        """Stop watching (the request is over)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    def _start_watching(self) -> None:
        if self._watcher is None and not self._closed and not self._answered:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    break
        except Exception as error:  # a server whose receive fails: nothing to watch
            logger.debug("request_id=%s disconnect watch: %r", _current_request_id.get(), error)
            return
        self._gone.set()
        if not self._answered and self._task is not None and not self._task.done():
            logger.info(
                "request_id=%s the client closed the connection before the answer; cancelled",
                _current_request_id.get(),
            )
            self._cancelled = True
            self._task.cancel()


class _BodyTooLarge(StarletteHTTPException):
    """A request body over QUARRY_API_MAX_BODY_BYTES (raised while it is being read)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over {limit} bytes (QUARRY_API_MAX_BODY_BYTES)")


def _refuse_early(scope: Scope, settings: Settings, request_id: str) -> Response | None:
    """The answer to a request refused before its body is read: no or a wrong API key on a
    protected route (401), or a declared body over the limit (413). None lets it through.

    Checked here, not only in a route dependency, because FastAPI reads and parses a
    body before it runs dependencies: a client without a key must not make the server
    buffer and parse what it sends.
    """
    headers = dict(scope["headers"])
    if _route_path(scope).startswith(_PROTECTED_PREFIX):
        given = headers.get(b"authorization", b"").decode("latin-1")
        if not _authorized(given, settings):
            return error_body(
                401,
                "unauthorized",
                _UNAUTHORIZED,
                request_id,
                headers={"WWW-Authenticate": "Bearer"},
            )
    declared = headers.get(b"content-length", b"").decode("latin-1")
    if declared.isdigit() and int(declared) > settings.api_max_body_bytes:
        return error_body(
            413,
            "body_too_large",
            str(_BodyTooLarge(settings.api_max_body_bytes).detail),
            request_id,
        )
    return None


def _route_path(scope: Scope) -> str:
    """The path the router matches: ``path`` less the ``root_path`` the app is mounted under
    (a proxy's prefix, ``uvicorn --root-path``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that raises _BodyTooLarge once more than ``limit`` body bytes came in
    (a chunked body declares no length)."""
    seen = 0

    async def limited_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge(limit)
        return message

    return limited_receive


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _SANE_REQUEST_ID.fullmatch(text) else None
    return None


# -- the query service ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stored:
    """What the collection behind the alias says about the model that built it."""

    fingerprint: Fingerprint | None
    metadata: dict[str, Any]
    vector_size: int | None


@dataclass(frozen=True, slots=True)
class _Refusal:
    kind: type[Refused]
    message: str


class _Outage:
    """A dependency's last failure, after which it is not asked again for ``cooldown_s``:
    every query would otherwise wait out its retries against a service known to be down.
    Once the cooldown is over one caller at a time asks it again (the others keep
    getting the outage) until it answers or fails again."""

    def __init__(self, cooldown_s: float) -> None:
        self.cooldown_s = cooldown_s
        self._last: tuple[float, ServiceUnavailable] | None = None  # (time.monotonic(), error)
        self._answered = -math.inf  # time.monotonic() of its last answer
        self._trial_since: float | None = None  # when the caller now asking again began

    def check(self) -> None:
        """Raise ServiceUnavailable while the last failure is under ``cooldown_s`` old, or
        while another caller is asking again after it (for at most ``cooldown_s`` more)."""
        last = self._last
        if last is None:
            return
        now = time.monotonic()
        if now - last[0] >= self.cooldown_s:
            trial = self._trial_since
            if trial is None or now - trial >= self.cooldown_s:
                self._trial_since = now  # this caller asks; one that vanished is replaced
                return
        raise self._cooling_down(now)

    def refuse(self) -> None:
        """Raise what :meth:`check` raises to a caller that does not ask, if the dependency
        failed and has not answered since: for a caller that would only queue behind
        the one asking it again."""
        if self._last is not None:
            raise self._cooling_down(time.monotonic())

    def failed_since(self, moment: float) -> bool:
        """Whether the last failure (still unanswered) came at or after ``moment``
        (``time.monotonic()``)."""
        return self._last is not None and self._last[0] >= moment

    def _cooling_down(self, now: float) -> _CoolingDown:
        assert self._last is not None
        failed_at, error = self._last
        age = now - failed_at
        if age < self.cooldown_s:
            detail = f"asked again {self.cooldown_s:g}s after that"
            left = self.cooldown_s - age
        else:
            detail = "another query is asking it again"
            trial = self._trial_since
            left = self.cooldown_s - (now - trial) if trial is not None else 1.0
        # A new error each time: raising the cached one would grow its traceback (and
        # keep every failed query's locals alive) until the service is back.
        return _CoolingDown(
            error.url,
            f"failed {age:.1f}s ago ({_reason(error)}); {detail}",
            status=error.status,
            retry_after_s=left,
        )

    def failed(self, error: ServiceUnavailable) -> None:
        """Record a failure (its retries spent): the cooldown starts now, when the service
        is unreachable or says it is down (502, 503, 504). A busy one (429) or one that
        failed on this input (424, 500) may serve the next query."""
        if says_down(error):
            self._last = (time.monotonic(), error)
        self._trial_since = None

    def recovered(self) -> None:
        """The dependency answered."""
        self._last = None
        self._trial_since = None
        self._answered = time.monotonic()

    def abandoned(self) -> None:
        """The caller asking again failed in a way that says nothing of the dependency
        (a one-attempt probe): the next caller may ask."""
        self._trial_since = None

    def timed_out(self, error: ServiceUnavailable, started: float) -> bool:
        """A call begun at ``started`` had no answer in its query's time: down (True),
        unless the dependency answered other calls meanwhile (busy: the call waited its
        turn, or the query's time went elsewhere)."""
        if self._answered < started:
            self.failed(error)
            return True
        return False


class QueryService:
    """The API's query path over the async clients; one per app, built in the lifespan."""

    def __init__(
        self,
        settings: Settings,
        store: AsyncStore,
        embedder: AsyncEmbeddingClient,
        reranker: AsyncRerankClient,
    ) -> None:
        self.settings = settings
        self.store = store
        self.embedder = embedder
        self.reranker = reranker
        self._verified: Fingerprint | None = None
        self._refused: _Refusal | None = None
        self._task_warning: str | None = None  # logged once per change
        self._judged_at = -math.inf  # time.monotonic() of the last verdict
        self._lock = asyncio.Lock()
        self._verifying = _QDRANT  # what the verify() under way (holding the lock) awaits
        self._recheck: asyncio.Task[None] | None = None
        # The embedding service failed since the verdict: it may be back as another model.
        self._seen_down = False
        self._reranker_outage = _Outage(RERANK_COOLDOWN_S)
        self._embedding_outage = _Outage(EMBED_COOLDOWN_S)
        self._rerank_retry = retry_policy(settings).capped(
            QUERY_RERANK_RETRY_S, "a query's cap for the reranker"
        )
        self._embed_retry = dataclasses.replace(
            retry_policy(settings).capped(
                QUERY_EMBED_RETRY_S, "a query's cap for the embedding service"
            ),
            on_retry=self._retried_embedding,
        )

    # -- the fingerprint verdict, cached ---------------------------------------------------

    async def fingerprint(self) -> Fingerprint:
        """The verified fingerprint of the index, from a verdict at most a recheck old.

        A verdict is cached and renewed every QUARRY_FINGERPRINT_RECHECK_SECONDS: a
        good one in the background while queries go on under it, a refusal in the
        request itself (that request fails anyway), so a model swapped behind the
        service's URL is refused, and a model put back is served again, within
        that time. The request itself judges afresh, before it embeds anything, when
        the embedding service failed since the verdict (a restart may bring another
        model back) or the verdict is two rechecks old (no query came to renew it).
        Raises ApiError: 409 when the live model did not build the index, 503 when
        Qdrant or the embedding service cannot be asked.
        """
        verified = self._verified
        if verified is not None and not self._must_rejudge():
            if self._stale() and self._recheck is None:
                # A context of its own: the request that happens to start it is not the one
                # its log lines are about.
                self._recheck = asyncio.create_task(
                    self._recheck_in_background(), context=Context()
                )
            return verified
        if self._seen_down and self._lock.locked():
            # Another request is judging the model anew after the embedding service
            # failed, and may be waiting out its retries: queueing behind it only waits.
            try:
                self._embedding_outage.refuse()
            except _CoolingDown as error:
                raise _dependency_down(_EMBEDDING, error) from None
        async with self._locked():
            if self._refused is None and (self._verified is None or self._must_rejudge()):
                await self.verify()
            elif self._refused is not None and self._stale():
                # One attempt: this request fails anyway if the dependency is down, and
                # the requests queued behind it take this verdict instead of trying again.
                try:
                    await self.verify(_PROBE)
                except ApiError as error:
                    if error.status != 409:
                        # The model cannot be asked now: the refusal no longer says what
                        # is served, and the queries after this one meet the outage
                        # (a 503 to retry), not a 409 telling them to reindex.
                        self._refused = None
                        self._judged_at = time.monotonic()
                        raise
            if self._refused is not None:
                raise _refusal(self._refused.kind(self._refused.message))
            assert self._verified is not None
            return self._verified

    def _retried_embedding(self, error: BaseException | None) -> None:
        """A query's embedding attempt failed and is retried: a service down even for a
        moment (restarting) may answer the retry as another model."""
        if isinstance(error, TransientFailure) and says_down(error) and not error.timed_out:
            self._seen_down = True  # (a timeout: slow, not gone)

    async def _judge_again(self, fingerprint: Fingerprint) -> None:
        """Judge the model afresh for a query that doubts ``fingerprint``, unless another
        request did while this one waited for the lock."""
        async with self._locked():
            if self._seen_down or self._verified is fingerprint:
                await self.verify()

    def _must_rejudge(self) -> bool:
        age = time.monotonic() - self._judged_at
        return self._seen_down or age > 2 * self.settings.fingerprint_recheck_seconds

    @asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """``self._lock``, waited for within the query's time: its holder is a verify()
        (perhaps the background recheck, on a deadline of its own) waiting on a dependency.

        The embedding service failing for a holder while this caller waited is what held
        it up (the holder after that one may be reading Qdrant when the time runs out),
        and a caller that then gets the lock meets that outage instead of asking again.
        """
        waited_from = time.monotonic()
        try:
            async with asyncio.timeout_at(_answer_by.get()):
                await self._lock.acquire()
        except TimeoutError:
            if self._embedding_outage.failed_since(waited_from):
                blame = _EMBEDDING
            else:
                blame = self._verifying
            raise _dependency_down(blame, self._no_answer(self._url_of(blame))) from None
        try:
            if self._embedding_outage.failed_since(waited_from):
                try:
                    self._embedding_outage.refuse()
                except _CoolingDown as error:
                    raise _dependency_down(_EMBEDDING, error) from None
            yield
        finally:
            self._lock.release()

    def _stale(self) -> bool:
        return time.monotonic() - self._judged_at > self.settings.fingerprint_recheck_seconds

    async def _recheck_in_background(self) -> None:
        try:
            async with self._lock:
                with _answer_within(self.settings.query_timeout):  # a hung service: not the lock
                    await self.verify(_PROBE)
        except ApiError as error:
            # A refusal is cached by verify(); a dependency that is down leaves the last
            # verdict standing (the queries meet the outage themselves) until the next try.
            if error.status != 409:
                logger.warning("quarry api: fingerprint recheck: %s", error.message)
        except Exception:  # never let a background task die unobserved
            logger.exception("quarry api: fingerprint recheck failed")
        finally:
            self._judged_at = time.monotonic()  # the next try is a recheck period away
            self._recheck = None

    async def verify(self, retry: RetryPolicy | None = None) -> Fingerprint:
        """Read the stored and the live fingerprints afresh and judge them (updates the cache).

        ``retry`` defaults to a query's (QUERY_EMBED_RETRY_S).
        """
        self._verifying = _QDRANT
        stored = await self._stored()
        self._verifying = _EMBEDDING
        live = await self._from_embedder(self.embedder.read_fingerprint, retry=retry)
        return self._judge(stored, live)

    async def _from_embedder(
        self,
        request: Callable[..., Awaitable[T]],
        *,
        retry: RetryPolicy | None = None,
        query_input: bool = False,
    ) -> T:
        """``await request(retry=...)`` of the embedding service (see :meth:`_call`); at once
        a 503 while it is known down. A failure under a query's own retries (no ``retry``),
        or no answer in the query's time, starts EMBED_COOLDOWN_S."""

        async def guarded() -> T:
            self._embedding_outage.check()
            try:
                answer = await request(retry=retry or self._embed_retry)
            except ServiceUnavailable as error:
                if says_down(error):
                    self._seen_down = True
                if retry is None:
                    self._embedding_outage.failed(error)
                else:
                    self._embedding_outage.abandoned()
                raise
            except ServiceError:  # it answered: a refusal of this input, or nonsense
                self._embedding_outage.recovered()
                raise
            except BaseException:  # cancelled (the query's time ran out): says nothing
                self._embedding_outage.abandoned()
                raise
            self._embedding_outage.recovered()
            return answer

        started = time.monotonic()
        try:
            return await self._call(_EMBEDDING, guarded(), query_input=query_input)
        except ApiError as error:
            if error.status == 504 and retry is None:  # hung: as good as down
                hung = self._no_answer(self.embedder.base_url)
                if self._embedding_outage.timed_out(hung, started):
                    self._seen_down = True
            raise

    async def _stored(self) -> _Stored:
        physical = await self._call(_QDRANT, self.store.resolve())
        if physical is None:
            misnamed = await self._call(_QDRANT, self.store.names_a_collection())
            alias = self.store.alias
            missing = f"collection {alias!r} does not exist yet; run `quarry ingest PATH`"
            raise ApiError(
                503,
                "collection_not_found",
                not_an_alias(alias) if misnamed else missing,
                dependency=_QDRANT,
            )
        metadata, size = await self._call(_QDRANT, self.store.describe(physical))
        return _Stored(stored_fingerprint(metadata), metadata, size)

    def _judge(self, stored: _Stored, live: Fingerprint) -> Fingerprint:
        try:
            verified = verify_fingerprint(
                stored.fingerprint,
                live,
                stored.metadata,
                collection=self.store.alias,
                vector_size=stored.vector_size,
                allow_serving_change=self.settings.allow_serving_change,
                canary_min_cosine=self.settings.canary_min_cosine,
            )
        except Refused as error:
            self._seen_down = False
            refusal = _Refusal(type(error), str(error))
            if refusal != self._refused:  # once per change, not once per readiness probe
                logger.error("quarry api refuses to answer queries: %s", error)
            self._verified, self._refused = None, refusal
            self._judged_at = time.monotonic()
            raise _refusal(error) from None
        if self._refused is not None:
            logger.info("quarry api: the embedding service matches the index again")
        task_warning = query_task_warning(stored.fingerprint, live, self.store.alias)
        if task_warning is not None and task_warning != self._task_warning:
            logger.warning("quarry api: %s", task_warning)  # once per change, as refusals
        self._task_warning = task_warning
        self._verified, self._refused = verified, None
        self._judged_at = time.monotonic()
        self._seen_down = False
        return verified

    async def aclose(self) -> None:
        """Stop a fingerprint recheck still running (before the clients it uses close)."""
        task, self._recheck = self._recheck, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def warm_up(self) -> None:
        """Check the fingerprint at startup; a failure is logged and left to /readyz."""
        budget = min(self.settings.retry_budget, 5.0)
        try:
            with _answer_within(budget + self.settings.query_timeout):  # startup is not held
                await self.verify(RetryPolicy(budget=budget))
        except ApiError as error:
            logger.warning("quarry api: startup check: %s", error.message)

    # -- queries ---------------------------------------------------------------------------

    async def query(self, body: QueryRequest) -> tuple[QueryResponse, dict[str, str]]:
        """Answer one query; also returns the response headers to add (warnings).

        Its dependency calls get QUARRY_QUERY_TIMEOUT in all: a reranker still silent
        then is a failed rerank, any other dependency a 504 naming it.
        """
        with _answer_within(self.settings.query_timeout):
            return await self._answer(body)

    async def _answer(self, body: QueryRequest) -> tuple[QueryResponse, dict[str, str]]:
        started = time.perf_counter()
        ids = body.filter.doc_ids if body.filter else None
        if ids and not self.settings.qdrant_url and len(ids) > LOCAL_MODE_MAX_DOC_IDS:
            # Local mode tests every point against every id, in Python, on the one
            # thread all queries share: 1,000 ids over 20,000 points held it for 3.4 s.
            limit = f"at most {LOCAL_MODE_MAX_DOC_IDS} ids with local-mode Qdrant"
            raise ApiError(
                422,
                "invalid_request",
                f"filter.doc_ids: {limit}, not {len(ids)} (it compares each id with every "
                "point); a Qdrant server (QUARRY_QDRANT_URL) takes up to 1000",
                details=[{"loc": ["body", "filter", "doc_ids"], "msg": limit, "type": "too_long"}],
            )
        query_text, truncated = self._fit_query(body.query, body.truncate)
        timings: dict[str, float] = {}
        for attempt in range(2):
            fingerprint = await self.fingerprint()
            mark = time.perf_counter()
            text, vector, cut = await self._embed(
                query_text, body.truncate, fingerprint.query_task or None
            )
            timings["embed"] = _ms_since(mark)
            dimensions = fingerprint.model.dimensions
            if self._seen_down or len(vector) != dimensions:
                # The service was down while this query's retries reached it, or its
                # vectors have another size: another model may be behind the URL. Judge
                # it now (a 409 naming both) and embed again; never search with this.
                if attempt:
                    raise _dependency_down(
                        _EMBEDDING,
                        BadResponse(
                            self.embedder.base_url,
                            f"a query vector of {len(vector)} dimensions; the index holds "
                            f"{dimensions}"
                            if len(vector) != dimensions
                            else "down again while its model was checked; try again",
                        ),
                    )
                await self._judge_again(fingerprint)
                continue

            mark = time.perf_counter()
            query_filter = _to_search_filter(body.filter)
            hits = await self._call(
                _QDRANT, self.store.search(vector, max(body.candidates, body.top_k), query_filter)
            )
            timings["search"] = _ms_since(mark)
            if not _other_model(hits, fingerprint):
                break
            # Points of another model: the alias moved (``quarry reindex``) since the
            # verdict. Judge the collection behind it now (unless a request did while this
            # one waited), and search again under that verdict; never answer with them.
            if attempt:
                raise _refusal(
                    FingerprintMismatch(
                        f"collection {self.store.alias!r} returned points written by another "
                        f"model than {fingerprint.model.describe()}; it may be changing under "
                        "a reindex: try again"
                    )
                )
            await self._judge_again(fingerprint)
        truncated = truncated or cut

        warnings = [self._task_warning] if self._task_warning else []
        headers: dict[str, str] = {}
        scores: list[float] | None = None
        outcome: RerankOutcome = "skipped"
        if body.rerank and hits:
            mark = time.perf_counter()
            try:
                scores, cut = await self._rerank_in_time(text, rerank_texts(hits), body.truncate)
                truncated = truncated or cut
                outcome = "reranked"
            except QueryTooLong:
                raise ApiError(
                    422,
                    "query_too_long",
                    "the query is too long for the reranker on its own (its max_input_length); "
                    'shorten it, send "truncate": true to cut it, or send "rerank": false',
                ) from None
            except _DEPENDENCY_ERRORS as error:
                if self.settings.rerank_required:
                    raise _dependency_down(_RERANKER, error) from None
                logger.warning(
                    "request_id=%s reranker failed, answering from vector scores: %s",
                    _current_request_id.get(),
                    error,
                )
                warnings.append(rerank_fallback_warning(_reason(error)))
                headers["Warning"] = _RERANK_WARNING
                outcome = "failed"
            timings["rerank"] = _ms_since(mark)

        results = rank_results(
            hits,
            scores,
            threshold=score_threshold(outcome, body.threshold, self.settings.rerank_threshold),
            collapse=body.collapse,
            top_k=body.top_k,
        )
        timings["total"] = _ms_since(started)
        response = QueryResponse(
            results=[Passage.model_validate(result, from_attributes=True) for result in results],
            model=ModelRef(**model_summary(fingerprint)),
            reranked=outcome == "reranked",
            truncated=truncated,
            warnings=warnings,
            timings_ms=timings,
        )
        return response, headers

    async def _rerank(self, query: str, texts: list[str]) -> list[float]:
        """Rerank scores, or at once the reranker's last outage while it is cooling down.

        A reranker that failed is not asked again for RERANK_COOLDOWN_S: every query
        would otherwise wait out the retries before falling back to vector scores.
        The retries of one query are capped at QUERY_RERANK_RETRY_S for the same reason.
        """
        self._reranker_outage.check()
        try:
            scores = await self.reranker.score(query, texts, retry=self._rerank_retry)
        except ServiceUnavailable as error:
            self._reranker_outage.failed(error)
            raise
        except ServiceError:  # it answered: a query too long, a rejection, nonsense
            self._reranker_outage.recovered()
            raise
        except BaseException:  # cancelled (QUARRY_RERANK_TIMEOUT): timed_out() judges
            self._reranker_outage.abandoned()
            raise
        self._reranker_outage.recovered()
        return scores

    async def _rerank_in_time(
        self, query: str, texts: list[str], truncate: bool
    ) -> tuple[list[float], bool]:
        """:meth:`_rerank_fitted` within QUARRY_RERANK_TIMEOUT (a required reranker: what
        is left of the query's time). A reranker that has not answered by then has
        failed (and starts RERANK_COOLDOWN_S)."""
        started = time.monotonic()
        within = (
            None
            if self.settings.rerank_required
            else (self.settings.rerank_timeout, "QUARRY_RERANK_TIMEOUT")
        )
        try:
            return await self._in_time(
                self._rerank_fitted(query, texts, truncate), self.reranker.base_url, within=within
            )
        except _NoAnswer as error:
            self._reranker_outage.timed_out(error, started)
            raise

    async def _rerank_fitted(
        self, query: str, texts: list[str], truncate: bool
    ) -> tuple[list[float], bool]:
        """Rerank scores, and whether the query was cut for them: with ``truncate``, a
        query too long for the reranker on its own is cut to half its input limit (room
        for the passages beside it), else halved, until it fits."""
        try:
            return await self._rerank(query, texts), False
        except QueryTooLong:
            if not truncate:
                raise
        from quarry.chunking import count_tokens

        info = await self.reranker.info(retry=self._rerank_retry)
        limit = info.max_input_length if info is not None else None
        for _attempt in range(4):
            tokens = count_tokens(query)
            # tiktoken is not the reranker's tokenizer: the margin is wide on purpose.
            target = min(tokens - 1, limit // 2) if limit else tokens // 2
            if target < 1:
                break
            query = _cut_to_tokens(query, target)
            try:
                return await self._rerank(query, texts), True
            except QueryTooLong:
                limit = None  # the estimate missed: halve from here on
        raise QueryTooLong(self.reranker.base_url, "no cut of the query fits the reranker")

    def _fit_query(self, query: str, truncate: bool) -> tuple[str, bool]:
        """The query within QUARRY_MAX_QUERY_TOKENS: as is, cut (``truncate``), or a 422."""
        from quarry.chunking import count_tokens

        limit = self.settings.max_query_tokens
        if len(query) * 4 <= limit:
            return query, False  # a token is at least one UTF-8 byte, a character at most four
        tokens = count_tokens(query)
        if tokens <= limit:
            return query, False
        if not truncate:
            raise ApiError(
                422,
                "query_too_long",
                f"the query is {tokens} tokens, over the limit of {limit} "
                '(QUARRY_MAX_QUERY_TOKENS); shorten it, or send "truncate": true to cut it',
            )
        return _cut_to_tokens(query, limit), True

    async def _embed(
        self, text: str, truncate: bool, task: str | None
    ) -> tuple[str, list[float], bool]:
        """Embed the query; an over-long one is refused (422) or, with ``truncate``, cut to fit."""
        from quarry.chunking import count_tokens

        truncated = False
        for _attempt in range(4):
            try:
                vector = await self._from_embedder(
                    functools.partial(self.embedder.embed_query, text, task=task),
                    query_input=True,
                )
            except _TooLong as error:
                info = await self._call(_EMBEDDING, self.embedder.info())
                limit = info.max_input_length
                if not truncate:
                    raise ApiError(
                        422,
                        "query_too_long",
                        "the query is longer than the embedding model accepts"
                        + (f" ({limit} tokens)" if limit else "")
                        + f': {error.reason}; shorten it, or send "truncate": true to cut it',
                    ) from None
                tokens = count_tokens(text)
                target = tokens // 2
                if limit and not truncated:
                    profile = await self.embedder.profile()
                    overhead = count_tokens(
                        profile.format_query("", task or self.embedder.query_task)
                    )
                    # tiktoken and the model's tokenizer differ: leave a wide margin.
                    target = min(tokens - 1, int(limit * 0.75) - overhead)
                if target < 1:
                    break
                text, truncated = _cut_to_tokens(text, target), True
            else:
                return text, vector, truncated
        raise ApiError(
            422,
            "query_too_long",
            "the query cannot be cut to fit the embedding model's input limit",
        )

    async def _call(
        self, dependency: str, awaitable: Awaitable[T], *, query_input: bool = False
    ) -> T:
        """Await a dependency; its failures become a 503 naming it, and no answer by
        the query's deadline (QUARRY_QUERY_TIMEOUT) a 504.

        With ``query_input``, InputTooLong (the client's query is too long for the
        model) becomes ``_TooLong`` instead: the client's fault, not the service's.
        """
        try:
            return await self._in_time(awaitable, self._url_of(dependency))
        except InputTooLong as error:
            if not query_input:
                raise _dependency_down(dependency, error) from None
            raise _TooLong(_reason(error)) from None
        except ApiError:
            raise
        except Exception as error:  # _NoAnswer among them: a 504
            if dependency != _QDRANT and not isinstance(error, _DEPENDENCY_ERRORS):
                raise
            raise _dependency_down(dependency, error) from None

    async def _in_time(
        self, awaitable: Awaitable[T], url: str, *, within: tuple[float, str] | None = None
    ) -> T:
        """``await awaitable`` by the query's deadline, or sooner within ``(seconds, the
        setting that says so)``; past it, raise _NoAnswer for ``url``."""
        answer_by = _answer_by.get()
        own_limit = None  # within, when it comes before the query's deadline
        if within is not None:
            own = asyncio.get_running_loop().time() + within[0]
            if answer_by is None or own < answer_by:
                answer_by, own_limit = own, within
        deadline = asyncio.timeout_at(answer_by)
        try:
            async with deadline:
                return await awaitable
        except TimeoutError:
            if not deadline.expired():
                raise
            if own_limit is not None:
                seconds, setting = own_limit
                raise _NoAnswer(url, f"no answer within {seconds:g}s ({setting})") from None
            raise self._no_answer(url) from None

    def _url_of(self, dependency: str) -> str:
        """Where ``dependency`` is, for the server's log (a client is never told)."""
        if dependency == _EMBEDDING:
            return self.embedder.base_url
        if dependency == _RERANKER:
            return self.reranker.base_url
        return self.settings.qdrant_url or f"local-mode Qdrant at {self.settings.qdrant_path}"

    def _no_answer(self, url: str) -> _NoAnswer:
        return _NoAnswer(
            url,
            f"no answer within the query's {self.settings.query_timeout:g}s (QUARRY_QUERY_TIMEOUT)",
        )

    # -- readiness and listing -------------------------------------------------------------

    async def readiness(self) -> dict[str, Check]:
        """Probe Qdrant, the embedding service and the reranker at once, then the fingerprint."""

        async def probe(
            awaitable: Awaitable[T], within: float = READY_TIMEOUT_S
        ) -> T | BaseException:
            try:
                return await asyncio.wait_for(awaitable, within)
            except TimeoutError:
                return TimeoutError(f"no answer within {within:g}s")
            except Exception as error:
                return error

        required = self.settings.rerank_required
        stored, live, reranker = await asyncio.gather(
            probe(self._stored()),
            probe(self.embedder.read_fingerprint(retry=_PROBE)),
            probe(
                self.reranker.probe(retry=_PROBE),
                READY_TIMEOUT_S if required else READY_OPTIONAL_TIMEOUT_S,
            ),
        )
        checks: dict[str, Check] = {}
        if isinstance(stored, BaseException):
            checks["qdrant"] = Check(ok=False, detail=_check_detail(stored))
        else:
            checks["qdrant"] = Check(ok=True, detail=f"collection {self.store.alias!r} found")
        if isinstance(live, BaseException):
            checks["embedding"] = Check(ok=False, detail=_check_detail(live))
        else:
            checks["embedding"] = Check(ok=True, detail=live.model.describe())
        if isinstance(reranker, BaseException):
            detail = _check_detail(reranker)
            if not required:
                detail += "; queries answer from vector scores (QUARRY_RERANK_REQUIRED is off)"
            checks["reranker"] = Check(ok=False, detail=detail, required=required)
        else:
            checks["reranker"] = Check(ok=True, detail="answers", required=required)
        if isinstance(stored, BaseException) or isinstance(live, BaseException):
            checks["fingerprint"] = Check(ok=False, detail="not checked: a dependency is down")
        else:
            try:
                verified = self._judge(stored, live)
            except ApiError as error:
                checks["fingerprint"] = Check(ok=False, detail=error.message)
            else:
                checks["fingerprint"] = Check(
                    ok=True, detail=f"compatible with {verified.model.describe()}"
                )
        return checks

    async def collections(self) -> CollectionList:
        """The alias's physical collections, with the model that built each."""
        with _answer_within(self.settings.query_timeout):
            found = await self._call(_QDRANT, self.store.collections())
        entries = []
        for info in found:
            fingerprint = stored_fingerprint(info.metadata)
            entries.append(
                CollectionEntry(
                    name=info.name,
                    aliases=list(info.aliases),
                    active=self.store.alias in info.aliases,
                    points=info.points,
                    model=ModelRef(**model_summary(fingerprint)) if fingerprint else None,
                    created_at=fingerprint.created_at if fingerprint else None,
                )
            )
        return CollectionList(alias=self.store.alias, collections=entries)


def _other_model(hits: Sequence[models.ScoredPoint], fingerprint: Fingerprint) -> bool:
    """Whether a hit was written under another model than ``fingerprint``'s."""
    expected = fingerprint.model_key
    for hit in hits:
        key = (hit.payload or {}).get("model_key")
        if isinstance(key, str) and key != expected:
            return True
    return False


class _TooLong(Exception):
    """The embedding service found the query over its max_input_length."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# A misbehaving service can also fail parsing (a missing key, a wrong type).
_DEPENDENCY_ERRORS = (ServiceError, KeyError, TypeError, ValueError, IndexError)


def _check_detail(error: BaseException) -> str:
    if isinstance(error, ApiError):
        return error.message
    return _reason(error)


def _to_search_filter(spec: QueryFilter | None) -> models.Filter | None:
    if spec is None:
        return None
    return SearchFilter(
        uri_prefix=spec.uri_prefix, doc_ids=spec.doc_ids, metadata=spec.metadata
    ).to_qdrant()


def _cut_to_tokens(text: str, limit: int) -> str:
    """The longest prefix of ``text`` within ``limit`` tokens (cl100k), re-counted to be sure."""
    from quarry.chunking import count_tokens, get_encoding

    ids = get_encoding().encode_ordinary(text)
    if len(ids) <= limit:
        return text
    cut = get_encoding().decode_bytes(ids[:limit]).decode("utf-8", "ignore")
    while cut and count_tokens(cut) > limit:
        cut = cut[:-1]
    cut = cut.rstrip()
    if not cut.strip():
        raise ApiError(422, "query_too_long", f"nothing of the query is left within {limit} tokens")
    return cut


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


# -- dependencies (FastAPI) -------------------------------------------------------------------


# The dependencies are ``async def`` although they do no I/O: FastAPI runs a plain
# ``def`` dependency in its thread pool, a thread hop per request for nothing.


async def app_settings(request: Request) -> Settings:
    """The app's Settings (given to :func:`create_app`)."""
    settings: Settings = request.app.state.settings
    return settings


async def get_query_service(request: Request) -> QueryService:
    """The QueryService the lifespan built."""
    service = getattr(request.state, "query_service", None)
    if not isinstance(service, QueryService):
        raise ApiError(503, "not_started", "the API has not finished starting")
    return service


SettingsDep = Annotated[Settings, Depends(app_settings)]
QueryServiceDep = Annotated[QueryService, Depends(get_query_service)]

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="QuarryApiKey",
    description="`Authorization: Bearer <QUARRY_API_KEY>`",
)


async def require_api_key(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless the request carries the API key (compared in constant time, never logged)."""
    given = credentials.credentials if credentials is not None else ""
    if _auth_enforced(settings) and not _key_matches(given, settings):
        raise _unauthorized()


def _authorized(authorization: str | None, settings: Settings) -> bool:
    """Whether an ``Authorization`` header passes: ``Bearer <QUARRY_API_KEY>``, or any
    value when auth is off."""
    if not _auth_enforced(settings):
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and _key_matches(given.strip(), settings)


def _unauthorized() -> ApiError:
    return ApiError(401, "unauthorized", _UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


_UNAUTHORIZED = "missing or wrong API key: send `Authorization: Bearer <QUARRY_API_KEY>`"
# Routes behind the key; /healthz, /readyz and the OpenAPI documents are open.
_PROTECTED_PREFIX = "/v1/"


def _api_key(settings: Settings) -> str | None:
    # Stripped: a key read from a mounted secret file often ends in a newline, which no
    # HTTP header can carry, so the unstripped key would lock every client out.
    key = settings.api_key.get_secret_value().strip() if settings.api_key is not None else ""
    return key or None


_HEADER_SAFE_KEY = re.compile(r"[\x21-\x7e]+")


def check_api_key_setting(settings: Settings) -> None:
    """Refuse (ConfigError) an API key that no client could send: a header carries
    printable ASCII, and a space would end the bearer token."""
    key = _api_key(settings)
    if key is not None and not _HEADER_SAFE_KEY.fullmatch(key):
        raise ConfigError(
            "QUARRY_API_KEY holds characters an HTTP header cannot carry (only printable "
            "ASCII without spaces works in `Authorization: Bearer <key>`): no client could "
            "send it. Choose another key, e.g. `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`."
        )


def _key_matches(given: str, settings: Settings) -> bool:
    """Whether ``given`` is the API key, compared in constant time (never logged)."""
    expected = _api_key(settings)
    if expected is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def _auth_enforced(settings: Settings) -> bool:
    return settings.api_auth == "enabled" and _api_key(settings) is not None


# -- the app ----------------------------------------------------------------------------------


_SERVER_TIMING_HEADER = {
    "description": "The server's own time on the request (`app;dur=<ms>`).",
    "schema": {"type": "string"},
}


def _error_response(description: str, example: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": ErrorBody,
        "description": description,
        "content": {"application/json": {"example": {"error": example}}},
    }


_ERR_422 = _error_response(
    "Bad input: an empty query, a query over the token limit (without `truncate`), "
    "an unknown field.",
    {
        "type": "query_too_long",
        "message": "the query is 731 tokens, over the limit of 512 (QUARRY_MAX_QUERY_TOKENS); "
        'shorten it, or send "truncate": true to cut it',
        "request_id": "5f0c2e0c9b4d4c4f8f3b3c1f0e0a9d11",
    },
)
_ERR_413 = _error_response(
    "A body over QUARRY_API_MAX_BODY_BYTES (refused before it is read).",
    {
        "type": "body_too_large",
        "message": "the request body is over 1048576 bytes (QUARRY_API_MAX_BODY_BYTES)",
        "request_id": "5f0c2e0c9b4d4c4f8f3b3c1f0e0a9d11",
    },
)
_ERR_401 = _error_response(
    "No or wrong API key.",
    {
        "type": "unauthorized",
        "message": "missing or wrong API key: send `Authorization: Bearer <QUARRY_API_KEY>`",
        "request_id": "5f0c2e0c9b4d4c4f8f3b3c1f0e0a9d11",
    },
)
_ERR_409 = _error_response(
    "The index was built by another model than the embedding service serves now.",
    {
        "type": "fingerprint_mismatch",
        "message": "collection 'quarry' was built with BAAI/bge-small-en-v1.5 (384d, bge-en, "
        "key 1a2b3c4d5e6f), but the embedding service now serves "
        "Qwen/Qwen3-Embedding-0.6B (1024d, qwen3, key 0f9e8d7c6b5a). ... Run `quarry "
        "reindex --collection quarry` ...",
        "request_id": "5f0c2e0c9b4d4c4f8f3b3c1f0e0a9d11",
    },
)
_ERR_503 = _error_response(
    "A dependency is down (named in `dependency`), or the index does not exist yet.",
    {
        "type": "dependency_unavailable",
        "message": "embedding service unavailable: still failing after 6 attempts in 5.0s "
        "(retry budget 5s): cannot connect: [Errno 111] Connection refused",
        "request_id": "5f0c2e0c9b4d4c4f8f3b3c1f0e0a9d11",
        "dependency": "embedding service",
    },
)
_ERR_504 = _error_response(
    "A dependency (named in `dependency`) had not answered when the query's time "
    "(QUARRY_QUERY_TIMEOUT) ran out.",
    {
        "type": "dependency_timeout",
        "message": "embedding service did not answer: no answer within the query's 15s "
        "(QUARRY_QUERY_TIMEOUT)",
        "request_id": "5f0c2e0c9b4d4c4f8f3b3c1f0e0a9d11",
        "dependency": "embedding service",
    },
)

_RESPONSE_EXAMPLE: dict[str, Any] = {
    "results": [
        {
            "text": "Each request carries the key as `Authorization: Bearer <QUARRY_API_KEY>`.",
            "score": 0.91,
            "vector_score": 0.62,
            "rerank_score": 0.91,
            "doc_id": "3f2a9c0e5b7d4e1f",
            "uri": "docs/operations/keys.md",
            "chunk_index": 2,
            "headings": ["Operations", "API keys"],
            "title": "API keys",
            "metadata": {"content_type": "text/markdown"},
        }
    ],
    "model": {"model_id": "BAAI/bge-small-en-v1.5", "model_key": "1a2b3c4d5e6f"},
    "reranked": True,
    "truncated": False,
    "warnings": [],
    "timings_ms": {"embed": 4.1, "search": 2.3, "rerank": 11.8, "total": 18.9},
}


def create_app(settings: Settings, *, freeze_heap: bool = False) -> FastAPI:
    """The query API for ``settings``; clients are built when it starts (lifespan).

    ``freeze_heap`` (what :func:`serve` asks for, in a process of its own) moves
    everything alive once startup is done out of the garbage collector's reach
    (``gc.freeze``): a local-mode collection is hundreds of thousands of payload
    objects, and a full collection that walks them all stalls a query for
    hundreds of milliseconds.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with AsyncExitStack() as stack:
            try:
                service = await _start_services(settings, stack)
            except QuarryError as error:
                app.state.startup_error = error
                raise
            if freeze_heap:
                gc.collect()
                gc.freeze()
            yield {"query_service": service}

    app = FastAPI(
        title="quarry query API",
        version=__version__,
        summary="Search an index that quarry built, with the model that built it.",
        description=(
            "Every response carries an `X-Request-ID` header (send your own to correlate), "
            'and every error has the shape `{"error": {"type", "message", '
            '"request_id"}}`.'
        ),
        lifespan=lifespan,
        # /v1/query/ is a 404 in the error shape, not a 307 with an empty body.
        redirect_slashes=False,
    )
    check_api_key_setting(settings)
    app.state.settings = settings
    app.state.startup_error = None
    protected = [Depends(require_api_key)] if _auth_enforced(settings) else []
    common_errors: dict[int | str, dict[str, Any]] = {401: _ERR_401} if protected else {}

    @app.post(
        "/v1/query",
        response_model=QueryResponse,
        # The key is checked in the handler: FastAPI's dependency resolution costs more
        # than the check itself on the route every application calls all day.
        openapi_extra={"security": [{_bearer.scheme_name: []}]} if protected else None,
        tags=["query"],
        summary="Search the index",
        responses={
            200: {
                "description": "Passages, best first. A `Warning` header says when the "
                "reranker was down and vector scores answered.",
                "content": {"application/json": {"example": _RESPONSE_EXAMPLE}},
                "headers": {
                    "Warning": {
                        "description": "Only when the rerank failed: "
                        '`199 quarry "rerank failed; answered from vector scores"`.',
                        "schema": {"type": "string"},
                    },
                    "Server-Timing": _SERVER_TIMING_HEADER,
                },
            },
            **common_errors,
            409: _ERR_409,
            413: _ERR_413,
            422: _ERR_422,
            503: {
                **_ERR_503,
                "headers": {
                    "Retry-After": {
                        "description": "Seconds until the failed dependency is asked again.",
                        "schema": {"type": "integer"},
                    }
                },
            },
            504: _ERR_504,
        },
    )
    async def query(
        request: Request,
        body: Annotated[
            QueryRequest,
            Body(
                openapi_examples={
                    "simple": {"summary": "A question", "value": {"query": "What is quarry?"}},
                    "filtered": {"summary": "Filtered, top 5", "value": _QUERY_EXAMPLE},
                    "vector-only": {
                        "summary": "No rerank, one passage per document",
                        "value": {"query": "backups", "rerank": False, "collapse": "doc"},
                    },
                }
            ),
        ],
    ) -> Response:
        """Embed the query with the index's model, search, rerank, threshold, top_k."""
        if not _authorized(request.headers.get("authorization"), settings):
            raise _unauthorized()
        answer, headers = await (await get_query_service(request)).query(body)
        return Response(
            answer.model_dump_json().encode("utf-8"),
            media_type="application/json",
            headers=headers,
        )

    @app.get(
        "/v1/collections",
        response_model=CollectionList,
        dependencies=protected,
        tags=["query"],
        summary="The collections behind the alias",
        responses={**common_errors, 503: _ERR_503, 504: _ERR_504},
    )
    async def collections(service: QueryServiceDep) -> CollectionList:
        """The alias's physical collections, newest first, with the model of each."""
        return await service.collections()

    @app.get("/healthz", response_model=Health, tags=["health"], summary="Alive")
    async def healthz() -> Health:
        """The process answers (no dependency is asked)."""
        return Health(status="ok")

    @app.get(
        "/readyz",
        response_model=ReadyBody,
        tags=["health"],
        summary="Ready to answer queries",
        responses={
            503: {
                "model": NotReadyBody,
                "description": "Something is wrong; `checks` says what.",
            }
        },
    )
    async def readyz(request: Request, service: QueryServiceDep) -> Response:
        """Embedding service and Qdrant answer (and the reranker, where
        `QUARRY_RERANK_REQUIRED` is set), and the fingerprint is compatible."""
        checks = await service.readiness()
        failed = [name for name, check in checks.items() if not check.ok and check.required]
        if not failed:
            return Response(
                ReadyBody(status="ready", checks=checks).model_dump_json().encode("utf-8"),
                media_type="application/json",
            )
        message = "; ".join(f"{name}: {checks[name].detail}" for name in failed)
        return error_body(
            503,
            "not_ready",
            f"not ready: {message}",
            _request_id(request),
            extra={"checks": {name: check.model_dump() for name, check in checks.items()}},
        )

    # Load balancers often probe with HEAD; the answer is GET's without the body.
    for path, probe in (("/healthz", healthz), ("/readyz", readyz)):
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)

    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(QuarryError, _on_quarry_error)
    app.add_middleware(RequestContext, owner=app)
    _document_request_id(app)
    return app


def _document_request_id(app: FastAPI) -> None:
    """Add the ``X-Request-ID`` response header to every documented response."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            header = {
                "description": "The request id: the caller's `X-Request-ID`, else a new one.",
                "required": True,
                "schema": {"type": "string"},
            }
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    for response in operation.get("responses", {}).values():
                        response.setdefault("headers", {})[REQUEST_ID_HEADER] = header
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _start_services(settings: Settings, stack: AsyncExitStack) -> QueryService:
    """Build the clients from settings (closing them with ``stack``) and check the index."""
    # Preloaded: the startup check and the first queries run under deadlines.
    local = start_local_tei_if_needed(settings, preload=True)
    embed_url = await asyncio.to_thread(stack.enter_context, local)
    embedder = async_embedding_client(settings, embed_url)
    stack.push_async_callback(embedder.aclose)
    reranker = async_rerank_client(settings, settings.rerank_url or embed_url)
    stack.push_async_callback(reranker.aclose)
    store = AsyncStore(open_async_qdrant(settings), settings.collection)
    stack.push_async_callback(store.close)
    service = QueryService(settings, store, embedder, reranker)
    stack.push_async_callback(service.aclose)
    # Building the tokenizer takes a second: do it now, not in the first query.
    from quarry.chunking import count_tokens

    await asyncio.to_thread(count_tokens, "warm up")
    await service.warm_up()
    if not _auth_enforced(settings):
        logger.warning(
            "quarry api: requests are not authenticated (%s)",
            "QUARRY_API_AUTH=disabled" if settings.api_auth == "disabled" else "no QUARRY_API_KEY",
        )
    return service


# -- serving ----------------------------------------------------------------------------------


_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _one_blas_thread(settings: Settings) -> AbstractContextManager[object]:
    """BLAS limited to one thread in this process while :func:`serve` runs, with
    local-mode Qdrant and no thread count set in the environment
    (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, which win).

    A local-mode search is one matrix-vector product over every stored vector, bound
    by memory bandwidth. OpenBLAS's other threads take about 1.5 ms off it (20,000
    vectors of 384 dimensions, 2 CPUs) but spin once it is done, on cores that the
    event loop, the HTTP clients and an embedding service on the same machine wait
    for: ``bench/query_latency.py`` measured a quarter less CPU per query with one.
    A Qdrant server searches in its own process: BLAS here is left alone.

    Set on the main thread, before the search threads start: threadpoolctl lets only
    the thread that set a limit change it while it holds, and an OpenMP build of
    OpenBLAS (not pip's or the image's, which use pthreads) keeps it per thread.
    """
    if settings.qdrant_url or any(os.environ.get(name) for name in _BLAS_THREAD_VARIABLES):
        return nullcontext()
    from threadpoolctl import threadpool_limits  # 30 ms to import: only where it is used

    limits: AbstractContextManager[object] = threadpool_limits(limits=1, user_api="blas")
    return limits


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_address(settings: Settings, host: str) -> None:
    """Refuse (ConfigError) to serve on a non-loopback address without an API key.

    Allowed: a loopback host; or a key (``QUARRY_API_KEY``); or
    ``QUARRY_API_AUTH=disabled`` when something in front of quarry authenticates.
    """
    if is_loopback(host) or settings.api_auth == "disabled" or _api_key(settings) is not None:
        return
    raise ConfigError(
        f"refusing to serve the query API on {host} without an API key: anyone who can reach "
        "it could query the index. Set QUARRY_API_KEY (clients then send `Authorization: "
        "Bearer <key>`), bind a loopback address (--host 127.0.0.1), or set "
        "QUARRY_API_AUTH=disabled if a proxy in front of quarry authenticates requests."
    )


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the query API under uvicorn until interrupted (``quarry api``).

    Raises ConfigError for a non-loopback host without a key (see
    :func:`check_bind_address`), and the QuarryError that stopped startup (e.g.
    StoreLocked when another process holds local-mode Qdrant).
    """
    check_bind_address(settings, host)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("quarry").setLevel(logging.INFO)
    # The HTTP clients log every request at INFO: three lines per query is noise.
    for name in ("httpx2", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    app = create_app(settings, freeze_heap=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on",
            access_log=False,  # quarry logs each request itself, with its request id
            timeout_keep_alive=75,
            # Queries in flight at SIGTERM end within their own time (a 504 at worst),
            # not cut off with a plain-text 500.
            timeout_graceful_shutdown=math.ceil(settings.query_timeout) + 2,
        )
    )
    try:
        with _one_blas_thread(settings):
            server.run()
    except SystemExit as exit_:  # uvicorn exits when startup fails or it cannot listen
        error = app.state.startup_error
        if isinstance(error, QuarryError):
            raise error from None
        raise ConfigError(
            f"the query API did not start on {host}:{port}; see the log above"
        ) from exit_
    error = app.state.startup_error
    if isinstance(error, QuarryError):
        raise error
