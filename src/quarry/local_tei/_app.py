"""The FastAPI application: TEI 1.9.3's routes, bodies, status codes and error bodies."""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._backends import Backend, EmbedJob, Encoded, PairJob, make_backend
from ._config import LocalTEIConfig
from ._engine import Done, Engine
from ._protocol import (
    COHERE_RERANK_REQUEST,
    EMBED_REQUEST,
    MAX_CHAR_MULTIPLIER,
    OPENAI_REQUEST,
    PAYLOAD_TOO_LARGE_TEXT,
    RERANK_REQUEST,
    TOKENIZE_REQUEST,
    WRONG_CONTENT_TYPE_TEXT,
    BodyRejected,
    Inputs,
    Struct,
    TEIError,
    dumps,
    empty_input,
    is_json_content_type,
    overloaded,
    parse_body,
    validation,
)
from ._stats import ServerStats

__all__ = ["create_app"]

T = TypeVar("T")

# Routes TEI serves without the API key (its "public" router).
# Routes outside TEI's API-key layer, whatever the method (a wrong one is a 405 there).
_PUBLIC: Final = frozenset({"/health", "/ping", "/metrics"})
_JSON: Final = "application/json"


def create_app(config: LocalTEIConfig, *, stats: ServerStats | None = None) -> FastAPI:
    """Build the ASGI application of a local TEI-compatible service.

    Nothing is loaded until the app starts (lifespan) or its first request. The
    counters are ``app.state.stats`` (the ``stats`` given, else a new one).
    """
    stats = stats if stats is not None else ServerStats()
    service = _Service(config, stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await service.startup()
        except Exception as exc:
            app.state.startup_error = exc  # for LocalTEIServer to report
            raise
        try:
            yield
        finally:
            await service.engine.aclose()

    app = FastAPI(
        title="quarry local TEI",
        version=config.engine_version,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # axum answers /embed/ with a 404, not a redirect
    app.state.stats = stats
    app.state.config = config
    # axum's get() answers HEAD too, without the body.
    for path in ("/health", "/", "/ping"):
        app.add_api_route(path, service.health, methods=["GET", "HEAD"])
    app.add_api_route("/info", service.info, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", service.metrics, methods=["GET", "HEAD"])
    for path in ("/embed", "/", "/invocations"):
        app.add_api_route(path, service.embed, methods=["POST"])
    for path in ("/v1/embeddings", "/embeddings"):
        app.add_api_route(path, service.openai_embed, methods=["POST"])
    app.add_api_route("/tokenize", service.tokenize, methods=["POST"])
    app.add_api_route("/rerank", service.rerank, methods=["POST"])
    if config.rerank_dialect == "cohere":
        app.add_api_route("/v1/rerank", service.rerank, methods=["POST"])
    # What an embedding model's TEI answers on the routes of other model kinds.
    app.add_api_route("/embed_sparse", service.not_sparse, methods=["POST"])
    app.add_api_route("/predict", service.not_classifier, methods=["POST"])
    app.add_exception_handler(StarletteHTTPException, _bare_http_error)
    app.add_middleware(_Gate, stats=stats, api_key=config.api_key)
    # TEI's default CORS layer (no --cors-allow-origin): any origin, GET and POST.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_methods=["GET", "POST"],
        allow_headers=["content-type"],
    )
    return app


async def _bare_http_error(_request: Request, exc: Exception) -> Response:
    # axum answers an unknown route or method with an empty body, not FastAPI's JSON.
    assert isinstance(exc, StarletteHTTPException)
    return Response(status_code=exc.status_code, headers=exc.headers)


class _Gate:
    """Counts requests and responses, and checks TEI's ``--api-key`` bearer token."""

    def __init__(self, app: ASGIApp, *, stats: ServerStats, api_key: str | None) -> None:
        self._app = app
        self._stats = stats
        self._expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"]
        self._stats.record_request(method, path)
        public = path in _PUBLIC or (path == "/" and method in ("GET", "HEAD"))
        if self._expected is not None and not public:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if given != self._expected:
                self._stats.record_response(401)
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-length", b"0")],
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._stats.record_response(int(message["status"]))
            await send(message)

        try:
            await self._app(scope, receive, counting_send)
        except Exception:
            if not started:
                self._stats.record_response(500)
            raise


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status_code=status, media_type=_JSON, headers=headers)


def _plain(error: BodyRejected) -> Response:
    return Response(error.text, status_code=error.status, media_type="text/plain; charset=utf-8")


def _error(error: TEIError, *, openai: bool = False, fault: bool = False) -> Response:
    headers = {"x-local-tei-fault": "injected"} if fault else None
    return _json(error.openai_body() if openai else error.body(), error.status, headers)


def _apply_limit(text: str, limit: int) -> str:
    # TEI cuts an over-long string at byte `limit` (a no-op if that is not a character
    # boundary) before tokenizing with truncation.
    raw = text.encode("utf-8", "surrogatepass")
    if limit < len(raw) and (raw[limit] & 0xC0) != 0x80:
        return raw[:limit].decode("utf-8", "surrogatepass")
    return text


def _keep(ids: list[int], n: int, direction: str) -> list[int]:
    if n <= 0:
        return []
    return ids[:n] if direction == "right" else ids[-n:]


def _longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """How many content tokens of each sequence a pair keeps (tokenizers' LongestFirst)."""
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)


def _finish(
    vectors: Sequence[npt.NDArray[np.float32]], dimensions: int | None, normalize: bool
) -> npt.NDArray[np.float32]:
    out = np.stack(vectors).astype(np.float32, copy=False)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        out = (out / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return np.ascontiguousarray(out)


def _timing_headers(start: float, chars: int, tokens: int, done: Sequence[Done]) -> dict[str, str]:
    n = max(1, len(done))
    total_ms = int((time.perf_counter() - start) * 1e3)
    queue_ms = int(sum(d.queue_s for d in done) / n * 1e3)
    inference_ms = int(sum(d.inference_s for d in done) / n * 1e3)
    return {
        "x-compute-type": "gpu+optimized",  # what TEI 1.9.3 sends, whatever the device
        "x-compute-time": str(total_ms),
        "x-compute-characters": str(chars),
        "x-compute-tokens": str(tokens),
        "x-total-time": str(total_ms),
        "x-tokenization-time": str(max(0, total_ms - queue_ms - inference_ms)),
        "x-queue-time": str(queue_ms),
        "x-inference-time": str(inference_ms),
    }


def _chars(item: str | list[int]) -> int:
    return len(item)


class _Service:
    """State and handlers of one app."""

    def __init__(self, config: LocalTEIConfig, stats: ServerStats) -> None:
        self.config = config
        self.stats = stats
        self.backend: Backend = make_backend(config)
        self.engine = Engine(self.backend, config, stats)
        self.max_len = config.effective_max_input_length
        self.char_limit = self.max_len * MAX_CHAR_MULTIPLIER
        self._rng = random.Random(config.seed)
        self._info: dict[str, Any] | None = None
        kind = "cosine" if config.backend == "minilm" else "token-overlap"
        self.rerank_model_id = f"quarry/local-tei-{kind}-rerank"

    # ------------------------------------------------------------------ plumbing

    async def startup(self) -> None:
        """Compute ``/info`` (and load the model, with ``preload``) before the first request."""
        if self.backend.blocking and self.config.preload:
            await asyncio.to_thread(self.backend.load)
        await self._get_info()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.backend.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _read(self, request: Request, struct: Struct) -> dict[str, Any]:
        # The whole body is read even when it will be refused, so that the client is not
        # cut off while still sending; what is over the limit is not kept.
        limit = self.config.payload_limit
        declared = request.headers.get("content-length", "")
        over = declared.isdigit() and int(declared) > limit
        size = 0
        chunks: list[bytes] = []
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                over = True
            if not over:
                chunks.append(chunk)
        if not is_json_content_type(request.headers.get("content-type")):
            raise BodyRejected(415, WRONG_CONTENT_TYPE_TEXT)
        if over:
            raise BodyRejected(413, PAYLOAD_TOO_LARGE_TEXT)
        return parse_body(b"".join(chunks), struct)

    def _truncation(self, asked: bool | None) -> bool:
        # TEI: req.truncate.unwrap_or(info.auto_truncate)
        return self.config.auto_truncate if asked is None else bool(asked)

    def _fault(self) -> TEIError | None:
        rate = self.config.fault_rate
        if rate <= 0 or self._rng.random() >= rate:
            return None
        if self._rng.random() < 0.5:
            return overloaded()
        return TEIError("Unhealthy", "unhealthy")

    def _batch_checks(self, inputs: Inputs, what: str = "inputs") -> None:
        if not inputs.batch:
            return
        if not inputs.items:
            raise TEIError("Empty", f"`{what}` cannot be empty")
        if len(inputs.items) > self.config.max_client_batch_size:
            raise TEIError(
                "Validation",
                f"batch size {len(inputs.items)} > maximum allowed batch size "
                f"{self.config.max_client_batch_size}",
            )

    def _prompt_error(self, prompt_name: str | None) -> TEIError | None:
        if prompt_name is None:
            return None
        # TEI's words when a prompt is asked for and the model has none configured.
        return validation(
            f"`default-prompt-name` is set to `{prompt_name}` but no prompts were found "
            "in the Sentence Transformers configuration"
        )

    def _truncate(self, enc: Encoded, max_len: int, direction: str) -> Encoded:
        if not enc.special:
            return self.backend.encode_ids(_keep(enc.ids, max_len, direction))
        keep = max_len - self.backend.specials_single
        return self.backend.from_content(_keep(enc.content(), keep, direction))

    def _encode_inputs(
        self,
        items: list[str | list[int]],
        truncate: bool,
        direction: str,
        prompt_name: str | None,
    ) -> list[Encoded | TEIError]:
        """Tokenize and validate each input as TEI's tokenization workers do."""
        prompt_error = self._prompt_error(prompt_name)
        if prompt_error is not None:
            # TEI refuses an empty input before it looks at the prompt.
            return [empty_input() if not item else prompt_error for item in items]
        out: list[Encoded | TEIError | None] = [None] * len(items)
        text_slots: list[int] = []
        texts: list[str] = []
        for i, item in enumerate(items):
            if not item:
                out[i] = empty_input()
                continue
            if len(item) > self.char_limit:
                if not truncate:
                    out[i] = validation(
                        f"`inputs` must have less than {self.char_limit} characters. "
                        f"Given: {len(item)}"
                    )
                    continue
                if isinstance(item, str):
                    item = _apply_limit(item, self.char_limit)
            if isinstance(item, str):
                text_slots.append(i)
                texts.append(item)
            else:
                try:
                    out[i] = self.backend.encode_ids(item)
                except TEIError as exc:
                    out[i] = exc
        if texts:
            for i, encoded in zip(text_slots, self.backend.encode_texts(texts), strict=True):
                out[i] = encoded
        result: list[Encoded | TEIError] = []
        for enc in out:
            assert enc is not None
            if isinstance(enc, Encoded) and len(enc.ids) > self.max_len:
                if truncate:
                    result.append(self._truncate(enc, self.max_len, direction))
                else:
                    result.append(
                        validation(
                            f"`inputs` must have less than {self.max_len} tokens. "
                            f"Given: {len(enc.ids)}"
                        )
                    )
            else:
                result.append(enc)
        return result

    def _encode_pairs(
        self, query: str, texts: list[str], truncate: bool, direction: str
    ) -> list[PairJob | TEIError]:
        """Tokenize and validate (query, text) pairs; the pair counts against the limit."""
        backend = self.backend
        half = self.char_limit // 2
        q_chars = len(query)
        short_query = _apply_limit(query, half) if truncate else query
        needs_short = [q_chars + len(t) > self.char_limit for t in texts]
        encs = backend.encode_texts(
            [
                query,
                short_query,
                *(
                    t if not over else _apply_limit(t, half) if truncate else ""
                    for t, over in zip(texts, needs_short, strict=True)
                ),
            ]
        )
        q_full, q_short, text_encs = encs[0], encs[1], encs[2:]
        budget = self.max_len - backend.specials_pair
        out: list[PairJob | TEIError] = []
        for text, over_chars, t_enc in zip(texts, needs_short, text_encs, strict=True):
            if not query and not text:
                out.append(empty_input())
                continue
            if over_chars and not truncate:
                out.append(
                    validation(
                        f"`inputs` must have less than {self.char_limit} characters. "
                        f"Given: {q_chars + len(text)}"
                    )
                )
                continue
            q_enc = q_short if over_chars else q_full
            q_ids, t_ids = q_enc.content(), t_enc.content()
            length = len(q_ids) + len(t_ids) + backend.specials_pair
            if length > self.max_len:
                if not truncate:
                    out.append(
                        validation(
                            f"`inputs` must have less than {self.max_len} tokens. Given: {length}"
                        )
                    )
                    continue
                keep_q, keep_t = _longest_first(len(q_ids), len(t_ids), budget)
                q_enc = backend.from_content(_keep(q_ids, keep_q, direction))
                t_enc = backend.from_content(_keep(t_ids, keep_t, direction))
                length = len(q_enc.content()) + len(t_enc.content()) + backend.specials_pair
            out.append(PairJob(q_enc, t_enc, length))
        return out

    async def _embed(
        self,
        inputs: Inputs,
        *,
        truncate: bool,
        direction: str,
        prompt_name: str | None,
        normalize: bool,
        dimensions: int | None,
    ) -> tuple[npt.NDArray[np.float32], int, list[Done]]:
        self._batch_checks(inputs)
        n = len(inputs.items)
        if not self.engine.try_acquire(n):
            raise overloaded()
        queued = False
        try:
            if dimensions == 0:
                raise validation("`dimensions` should be positive")
            encs = await self._call(
                self._encode_inputs, inputs.items, truncate, direction, prompt_name
            )
            too_wide = dimensions is not None and dimensions > self.backend.dims
            for enc in encs:
                # Per input TEI tokenizes first and checks the width after embedding; the
                # request answers with the first input's error.
                if isinstance(enc, TEIError):
                    raise enc
                if too_wide:
                    raise validation(
                        "`dimensions` should be smaller than the maximum embedding dimension."
                    )
            jobs = [EmbedJob(enc) for enc in encs if isinstance(enc, Encoded)]
            queued = True
            done = await self.engine.run(jobs)
        finally:
            if not queued:
                self.engine.release(n)
        vectors = [d.result for d in done]
        finished = _finish(vectors, dimensions, normalize)  # type: ignore[arg-type]
        tokens = sum(job.n_tokens for job in jobs)
        return finished, tokens, done

    async def _get_info(self) -> dict[str, Any]:
        if self._info is None:
            sha = await self._call(self.backend.model_sha)
            config = self.config
            self._info = {
                "model_id": self.backend.model_id,
                "model_sha": sha,
                "model_dtype": "float32",
                "model_type": {"embedding": {"pooling": "mean"}},
                "served_model_name": self.backend.model_id,
                "max_concurrent_requests": config.max_concurrent_requests,
                "max_input_length": self.max_len,
                "max_batch_tokens": config.max_batch_tokens,
                "max_batch_requests": None,
                "max_client_batch_size": config.max_client_batch_size,
                "auto_truncate": config.auto_truncate,
                "tokenization_workers": 1,
                "version": config.engine_version,
                "sha": None,
                "docker_label": None,
                "rerank_model_id": f"{self.rerank_model_id} (stand-in, not a cross-encoder)",
                "rerank_dialect": config.rerank_dialect,
            }
        return self._info

    # -------------------------------------------------------------------- routes

    async def health(self) -> Response:
        """``GET /health``: 200 with an empty body."""
        return Response(status_code=200)

    async def info(self) -> Response:
        """``GET /info``: TEI's ``Info``, plus the name of the rerank stand-in."""
        return _json(await self._get_info())

    async def metrics(self) -> Response:
        """``GET /metrics``: a few of TEI's Prometheus counters, from the service's stats."""
        stats = self.stats.snapshot()
        successes = sum(n for status, n in self.stats.responses.items() if status < 400)
        failures = sum(n for status, n in self.stats.responses.items() if status >= 400)
        lines = [
            "# TYPE te_request_success counter",
            f'te_request_success{{method="all"}} {successes}',
            "# TYPE te_request_failure counter",
            f'te_request_failure{{err="all"}} {failures}',
            "# TYPE te_embed_count counter",
            f"te_embed_count {stats['inputs_embedded']}",
            "# TYPE te_batch_next_size counter",
            f"te_batch_next_size {stats['steps']}",
            "# TYPE te_batch_next_tokens counter",
            f"te_batch_next_tokens {stats['tokens_processed']}",
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; charset=utf-8")

    async def not_sparse(self) -> Response:
        """``POST /embed_sparse``: a dense embedding model has no sparse output (424)."""
        return _error(TEIError("Backend", "Model is not an embedding model with SPLADE pooling"))

    async def not_classifier(self) -> Response:
        """``POST /predict``: an embedding model is not a classifier (424)."""
        return _error(TEIError("Backend", "Model is not a classifier model"))

    async def embed(self, request: Request) -> Response:
        """``POST /embed``."""
        start = time.perf_counter()
        try:
            req = await self._read(request, EMBED_REQUEST)
        except BodyRejected as exc:
            return _plain(exc)
        fault = self._fault()
        if fault is not None:
            return _error(fault, fault=True)
        inputs: Inputs = req["inputs"]
        try:
            vectors, tokens, done = await self._embed(
                inputs,
                truncate=self._truncation(req["truncate"]),
                direction=req["truncation_direction"],
                prompt_name=req["prompt_name"],
                normalize=req["normalize"],
                dimensions=req["dimensions"],
            )
        except TEIError as exc:
            return _error(exc)
        chars = sum(_chars(item) for item in inputs.items)
        return _json(vectors, headers=_timing_headers(start, chars, tokens, done))

    async def openai_embed(self, request: Request) -> Response:
        """``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's embeddings API."""
        start = time.perf_counter()
        try:
            req = await self._read(request, OPENAI_REQUEST)
        except BodyRejected as exc:
            return _plain(exc)
        fault = self._fault()
        if fault is not None:
            return _error(fault, openai=True, fault=True)
        inputs: Inputs = req["input"]
        try:
            vectors, tokens, done = await self._embed(
                inputs,
                truncate=self.config.auto_truncate,  # no per-request choice here
                direction="right",
                prompt_name=None,
                normalize=True,
                dimensions=req["dimensions"],
            )
        except TEIError as exc:
            return _error(exc, openai=True)
        data: list[dict[str, Any]]
        if req["encoding_format"] == "base64":
            little = vectors.astype("<f4", copy=False)
            data = [
                {
                    "object": "embedding",
                    "embedding": base64.b64encode(row.tobytes()).decode("ascii"),
                    "index": i,
                }
                for i, row in enumerate(little)
            ]
        else:
            data = [
                {"object": "embedding", "embedding": row, "index": i}
                for i, row in enumerate(vectors)
            ]
        body = {
            "object": "list",
            "data": data,
            "model": self.backend.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        chars = sum(_chars(item) for item in inputs.items)
        return _json(body, headers=_timing_headers(start, chars, tokens, done))

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: the backend tokenizer's tokens (no permits, no length limit)."""
        try:
            req = await self._read(request, TOKENIZE_REQUEST)
        except BodyRejected as exc:
            return _plain(exc)
        fault = self._fault()
        if fault is not None:
            return _error(fault, fault=True)
        inputs: Inputs = req["inputs"]
        try:
            self._batch_checks(inputs)
            tokens = await self._call(
                self._tokenize_all, inputs.items, req["add_special_tokens"], req["prompt_name"]
            )
        except TEIError as exc:
            return _error(exc)
        return _json(tokens)

    def _tokenize_all(
        self, items: list[str | list[int]], add_special_tokens: bool, prompt_name: str | None
    ) -> list[list[dict[str, Any]]]:
        prompt_error = self._prompt_error(prompt_name)
        out = []
        for item in items:
            assert isinstance(item, str)
            if not item:
                raise empty_input()
            if prompt_error is not None:
                raise prompt_error
            if len(item) > self.char_limit:
                raise validation(
                    f"`inputs` must have less than {self.char_limit} characters. Given: {len(item)}"
                )
            out.append(self.backend.tokenize(item, add_special_tokens))
        return out

    async def rerank(self, request: Request) -> Response:
        """``POST /rerank``: TEI's body, or the Cohere-style one in that dialect."""
        start = time.perf_counter()
        cohere = self.config.rerank_dialect == "cohere"
        try:
            req = await self._read(request, COHERE_RERANK_REQUEST if cohere else RERANK_REQUEST)
        except BodyRejected as exc:
            return _plain(exc)
        fault = self._fault()
        if fault is not None:
            return _error(fault, fault=True)
        texts: list[str] = req["documents"] if cohere else req["texts"]
        query: str = req["query"]
        try:
            if not texts:
                raise TEIError("Empty", f"`{'documents' if cohere else 'texts'}` cannot be empty")
            if len(texts) > self.config.max_client_batch_size:
                raise TEIError(
                    "Validation",
                    f"batch size {len(texts)} > maximum allowed batch size "
                    f"{self.config.max_client_batch_size}",
                )
            scores, tokens, done = await self._rerank(
                query, texts, self._truncation(req["truncate"]), req["truncation_direction"]
            )
        except TEIError as exc:
            return _error(exc)
        if not req["raw_scores"]:
            scores = [(s + 1.0) / 2.0 for s in scores]
        # TEI sorts ascending and reverses, so equal scores come out last index first.
        order = sorted(range(len(texts)), key=lambda i: scores[i])[::-1]
        chars = len(query) * len(texts) + sum(len(t) for t in texts)
        headers = _timing_headers(start, chars, tokens, done)
        if cohere:
            top_n = req["top_n"]
            if top_n is not None:
                order = order[:top_n]
            results = []
            for i in order:
                result: dict[str, Any] = {"index": i, "relevance_score": np.float32(scores[i])}
                if req["return_documents"]:
                    result["document"] = texts[i]
                results.append(result)
            body: Any = {
                "object": "rerank",
                "results": results,
                "model": self.rerank_model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return _json(body, headers=headers)
        ranks = []
        for i in order:
            rank: dict[str, Any] = {"index": i}
            if req["return_text"]:
                rank["text"] = texts[i]
            rank["score"] = np.float32(scores[i])
            ranks.append(rank)
        return _json(ranks, headers=headers)

    async def _rerank(
        self, query: str, texts: list[str], truncate: bool, direction: str
    ) -> tuple[list[float], int, list[Done]]:
        n = len(texts)
        if not self.engine.try_acquire(n):
            raise overloaded()
        queued = False
        try:
            pairs = await self._call(self._encode_pairs, query, texts, truncate, direction)
            jobs: list[PairJob] = []
            for pair in pairs:
                if isinstance(pair, TEIError):
                    raise pair
                jobs.append(pair)
            queued = True
            done = await self.engine.run(jobs)
        finally:
            if not queued:
                self.engine.release(n)
        scores = [float(d.result) for d in done]
        return scores, sum(job.n_tokens for job in jobs), done
