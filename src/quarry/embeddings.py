"""Embedding client for TEI and OpenAI-compatible services.

Passages are embedded raw (or as their prompt profile says); queries are
formatted here and nowhere else. Requests are sized from the service's
``/info`` limits, sent a few at a time, retried only when the failure is
transient, and an input the service finds too long is split and embedded in
parts, never truncated.

Passage and query vectors come back at unit length, whatever the service sends
(TEI normalises by default; other engines may not): quarry's collections rank by
dot product, which for unit vectors is the cosine (see :mod:`quarry.store`).
``embed_raw`` returns what the service sent, so the fingerprint can record whether
the service itself normalises.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
import numpy as np
import numpy.typing as npt
import openai

from quarry._http import (
    RetryPolicy,
    TransientFailure,
    answer_late,
    call_with_retries,
    http_client,
    info_timeout,
    json_answer,
    raise_for_status,
    request_json,
    says_down,
)
from quarry._pacing import Pacer
from quarry.config import DEFAULT_QUERY_TASK
from quarry.errors import (
    BadResponse,
    InputTooLong,
    RequestRejected,
    ServiceError,
    ServiceUnavailable,
    VectorsOfAnotherSize,
)
from quarry.prompts import ProfileName, PromptProfile, profile_for_model

logger = logging.getLogger(__name__)

# TEI rejects bodies over 2 MB by default; stay well clear of it.
MAX_BODY_BYTES = 1_500_000
# Counting with /tokenize: an input whose bytes plus this many special tokens are within
# max_input_length surely fits (no tokenizer in use emits more tokens than bytes).
_SPECIAL_TOKENS_ALLOWANCE = 8
# Batches are sent as they are; once this share of them (and at least two) came back 422
# for an over-long input, the client counts every batch with /tokenize before sending.
_TOO_LONG_SHARE = 0.1
DEFAULT_BATCH_SIZE = 32

EmbedDialect = Literal["auto", "tei", "openai"]

#: One embedding: a float32 row as the service's answer is decoded (4 bytes a value;
#: a list of Python floats costs 32, which for every chunk of a 200 MB file awaiting
#: its write was gigabytes), or a list of floats as the store gives them back.
Vector = list[float] | npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """What a service says about itself (TEI ``/info``), or what could be learned without it."""

    url: str
    model_id: str
    model_sha: str | None = None
    dtype: str | None = None
    pooling: str | None = None
    engine: str = "unknown"
    engine_version: str | None = None
    max_input_length: int | None = None
    max_batch_tokens: int | None = None
    max_client_batch_size: int | None = None
    max_concurrent_requests: int | None = None
    # TEI's --auto-truncate (default true since 1.9): /v1/embeddings, which cannot ask
    # otherwise, then cuts an over-long input to fit instead of refusing it.
    auto_truncate: bool = False
    raw: dict[str, Any] = field(default_factory=dict)

    def inputs_per_request(self, default: int) -> int:
        """How many inputs one request may carry: ``max_client_batch_size`` (``default``
        when unknown), and never over ``max_concurrent_requests``: TEI takes a permit per
        input, so a larger request is refused (429) however long it waits."""
        limit = self.max_client_batch_size or default
        return min(limit, self.max_concurrent_requests or limit)

    @classmethod
    def from_tei(cls, url: str, info: dict[str, Any]) -> ServiceInfo:
        """Parse TEI's ``/info`` body; BadResponse when its model name is not text (a
        collection would be created for a model named ``5``, refusing the real one)."""
        key = "model_id" if info.get("model_id") is not None else "served_model_name"
        if info.get(key) is not None and not isinstance(info[key], str):
            raise BadResponse(f"{url}/info", f"{key} is {info[key]!r:.40}, not a model name")
        model_type = info.get("model_type") or {}
        pooling = None
        if isinstance(model_type, dict):
            embedding = model_type.get("embedding")
            if isinstance(embedding, dict):
                pooling = embedding.get("pooling")
        return cls(
            url=url,
            model_id=str(info.get("model_id") or info.get("served_model_name") or "unknown"),
            model_sha=info.get("model_sha"),
            dtype=info.get("model_dtype"),
            pooling=pooling,
            engine="tei",
            engine_version=info.get("version"),
            max_input_length=_int_or_none(info.get("max_input_length")),
            max_batch_tokens=_int_or_none(info.get("max_batch_tokens")),
            max_client_batch_size=_int_or_none(info.get("max_client_batch_size")),
            max_concurrent_requests=_int_or_none(info.get("max_concurrent_requests")),
            auto_truncate=info.get("auto_truncate") is True,
            raw=dict(info),
        )


EMBED_ROUTE_HINT = "This service has no TEI /embed route: set QUARRY_EMBED_DIALECT=openai."
"""Said with a 404 or 405 from ``/embed``: the service speaks only the OpenAI dialect."""


def embed_dialect(setting: EmbedDialect, info: ServiceInfo) -> Literal["tei", "openai"]:
    """The route embeddings go by: QUARRY_EMBED_DIALECT, with ``auto`` resolved for
    ``info``'s service (``openai``, unless the service would cut over-long input)."""
    if setting == "tei" or (setting == "auto" and info.auto_truncate):
        return "tei"
    return "openai"


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and value > 0 else None


@dataclass(frozen=True, slots=True)
class EmbeddedPart:
    """One embedded piece of an input: the input itself, or a part of it after a split."""

    text: str
    vector: Vector


@dataclass(frozen=True, slots=True)
class EmbedFailure:
    """An input the service rejected for a reason splitting cannot fix."""

    error: ServiceError


EmbedResult = list[EmbeddedPart] | EmbedFailure


def fetch_info(
    client: httpx2.Client, url: str, policy: RetryPolicy, *, api_name: str = "/info"
) -> dict[str, Any] | None:
    """GET ``/info``; None when the service has no such route (a gateway, infinity)."""
    target = f"{url}{api_name}"

    def attempt() -> dict[str, Any] | None:
        try:
            response = client.get(target, timeout=info_timeout(client.timeout, policy))
        except httpx2.TimeoutException as error:
            raise TransientFailure.timeout(target, error) from error
        except httpx2.TransportError as error:
            raise TransientFailure.transport(target, error) from error
        if response.status_code in (404, 405):
            return None
        raise_for_status(target, response.status_code, response.content, response.headers)
        body = json_answer(target, response)  # a gateway's login page is no /info
        return body if isinstance(body, dict) else None

    return call_with_retries(policy, target, attempt)


class EmbeddingClient:
    """Embeds passages and queries through one service.

    ``transport`` is injected for tests (an ``httpx2.MockTransport``); production
    uses the default HTTP transport. Nothing is fetched until first use.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        transport: httpx2.BaseTransport | None = None,
        timeout: float = 60.0,
        retry: RetryPolicy = RetryPolicy(),
        batch_size: int | None = None,
        concurrency: int | None = None,
        prompt_profile: ProfileName | None = None,
        query_task: str = DEFAULT_QUERY_TASK,
        dialect: EmbedDialect = "auto",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._model = model
        # Attempts that found the service unreachable or down (502, 503, 504): it may
        # have been restarted, and come back as another model (IndexSync checks).
        self.interruptions = 0
        retry = dataclasses.replace(
            retry, on_retry=functools.partial(self._attempt_failed, retry.on_retry)
        )
        self._retry = retry
        # Embedding requests' timeouts are not retried as they come: _post_batch sends
        # them again at a lower depth.
        self._paced_retry = dataclasses.replace(retry, retry_timeouts=False)
        self._timeout = timeout
        self._batch_size = batch_size
        self._concurrency = concurrency
        self._profile_override = prompt_profile
        self.query_task = query_task
        self._dialect = dialect
        self._http = http_client(transport=transport, timeout=timeout, api_key=api_key)
        self._openai = openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or "unused",
            max_retries=0,
            timeout=timeout,
            http_client=http_client(transport=transport, timeout=timeout),
        )
        self._info: ServiceInfo | None = None
        self._info_lock = threading.Lock()
        # The model's vector size, once known (the index's fingerprint): a batch answered
        # at another size is a BadResponse, not a write Qdrant refuses.
        self.dimensions: int | None = None
        self.requests_sent = 0
        self._can_tokenize = True
        # Batches sent as they were, how many of those a service found too long, and
        # whether the inputs are now counted before sending (see _embed_batch).
        self._batches_sent = 0
        self._batches_too_long = 0
        self._count_first = False
        self._count_lock = threading.Lock()
        # One pool per client, shared by every caller: ``concurrency`` bounds the requests
        # in flight for the whole client, however many threads (Prefect tasks) embed at once.
        self._pool: ThreadPoolExecutor | None = None
        # Done when cancel_pending() is called; each call puts a fresh one in its place.
        self._cancelled: Future[None] = Future()
        self._pace: Pacer | None = None
        self._pool_lock = threading.Lock()

    # -- what the service is -------------------------------------------------------------

    @property
    def info(self) -> ServiceInfo:
        """The service's identity and limits, fetched once."""
        with self._info_lock:
            if self._info is None:
                self._info = self._load_info()
            return self._info

    def refresh_info(self) -> ServiceInfo:
        """Fetch ``/info`` again (after an interruption: a restart may have changed it)."""
        fresh = self._load_info()
        with self._info_lock:
            self._info = fresh
        return fresh

    def _attempt_failed(
        self, chained: Callable[[BaseException | None], None] | None, error: BaseException | None
    ) -> None:
        if isinstance(error, TransientFailure) and not error.timed_out and says_down(error):
            with self._count_lock:
                self.interruptions += 1
        if chained is not None:
            chained(error)

    def _load_info(self) -> ServiceInfo:
        raw = fetch_info(self._http, self.base_url, self._retry)
        if raw is not None and "model_id" in raw:
            return ServiceInfo.from_tei(self.base_url, raw)
        model_id = self._model or self._model_from_listing() or "unknown"
        return ServiceInfo(url=self.base_url, model_id=model_id)

    def _model_from_listing(self) -> str | None:
        try:
            listing = request_json(self._http, self._retry, "GET", f"{self.base_url}/v1/models")
        except RequestRejected:
            return None
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            return str(data[0].get("id"))
        return None

    @property
    def model_name(self) -> str:
        """The model name sent with OpenAI-style requests."""
        return self._model or self.info.model_id

    @property
    def profile(self) -> PromptProfile:
        """The prompt profile in force (explicit setting, else from the model id)."""
        return profile_for_model(self.info.model_id, self._profile_override)

    @property
    def dialect(self) -> Literal["tei", "openai"]:
        """``openai`` (``/v1/embeddings``, every TEI and gateway) unless set to ``tei``;
        ``auto`` takes ``tei`` for a TEI run with ``--auto-truncate``, where only
        ``/embed`` (``truncate: false``) refuses an over-long input instead of cutting it."""
        return embed_dialect(self._dialect, self.info)

    @property
    def _service_truncates(self) -> bool:
        """Whether an over-long input would be cut to fit, not refused with a 422
        (QUARRY_EMBED_DIALECT=openai set against a TEI run with ``--auto-truncate``)."""
        return self.dialect == "openai" and self.info.auto_truncate

    @property
    def batch_size(self) -> int:
        """Inputs per request: what the service takes (:meth:`ServiceInfo.inputs_per_request`),
        lowered by ``QUARRY_EMBED_BATCH_SIZE``."""
        limit = self.info.inputs_per_request(DEFAULT_BATCH_SIZE)
        return min(limit, self._batch_size) if self._batch_size else limit

    @property
    def concurrency(self) -> int:
        """Requests in flight at once; from ``/info`` capacity unless set."""
        if self._concurrency:
            return self._concurrency
        capacity = self.info.max_concurrent_requests
        if capacity is None:
            return 4
        return max(1, min(16, capacity // max(1, self.batch_size)))

    # -- embedding -----------------------------------------------------------------------

    def embed_query(self, query: str, task: str | None = None) -> list[float]:
        """Embed a search query, formatted by the model's prompt profile and ``task``
        (the index's recorded task; the client's configured one when not given)."""
        text = self.profile.format_query(query, task or self.query_task)
        vector: list[float] = self._post_batch([text], documents=())[0].tolist()
        return vector

    def embed_raw(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed texts exactly as given, one request per batch, no splitting (probes, canary).

        The vectors are the service's own, not scaled: the fingerprint records from the
        canary whether the service normalises."""
        out: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            batch = list(texts[start : start + self.batch_size])
            out.extend(self._post_batch(batch, (), unit=False).tolist())
        return out

    def embed_passages(
        self, texts: Sequence[str], *, documents: Sequence[str] | None = None
    ) -> list[EmbedResult]:
        """Embed passages; one result per input, in order.

        An input the service finds too long comes back as several parts (split at
        the strongest boundary near its middle). An input the service rejects for
        another reason comes back as an :class:`EmbedFailure`; the rest of its batch
        is unaffected. ``documents`` (one uri per input) name the inputs in errors.
        Transient failures that outlast the retry budget raise ServiceUnavailable.

        Batches go to the client's shared pool as soon as they are sized, so the first
        requests are in flight while the rest are still being measured.
        """
        names = list(documents) if documents is not None else [""] * len(texts)
        profile = self.profile
        formatted = [profile.format_passage(text) for text in texts]
        batches = self._batches(formatted)
        first = next(batches, None)
        if first is None:
            return []
        second = next(batches, None)
        if second is None or self.concurrency == 1:
            results: list[EmbedResult] = []
            rest = itertools.chain([second], batches) if second is not None else batches
            for start, end in itertools.chain([first], rest):
                results.extend(self._embed_batch(list(texts[start:end]), names[start:end]))
            return results
        pool = self._shared_pool()
        cancelled = self._cancelled
        futures = [
            pool.submit(self._embed_batch, list(texts[start:end]), names[start:end])
            for start, end in itertools.chain([first, second], batches)
        ]
        try:
            return [result for future in futures for result in _outcome(future, cancelled)]
        finally:
            for future in futures:  # a failed batch abandons the batches not yet started
                future.cancel()

    def cancel_pending(self) -> None:
        """Cancel the embedding requests not sent yet, queued or waiting for room in
        flight (their callers get CancelledError at once); those in flight are
        abandoned (answered, nobody reads them). Later calls work as before."""
        with self._pool_lock:
            cancelled, self._cancelled = self._cancelled, Future()
            pool, self._pool = self._pool, None
            pacer = self._pace
        cancelled.set_result(None)
        if pool is not None:  # its requests in flight are not waited for, here or in close()
            pool.shutdown(wait=False, cancel_futures=True)
        if pacer is not None:
            # A pool starts a thread per request, so most wait in the pacer, not the queue.
            pacer.cancel_waiting()

    def _shared_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.concurrency, thread_name_prefix="quarry-embed"
                )
            return self._pool

    def _batches(self, texts: Sequence[str]) -> Iterator[tuple[int, int]]:
        """Index ranges that respect the batch size, the body limit and max_batch_tokens.

        Tokens are estimated only when a batch could exceed ``max_batch_tokens``: when
        ``max_client_batch_size`` inputs of ``max_input_length`` tokens fit in it (TEI's
        defaults: 32 x 512 = 16384), every batch the service accepts fits in it too.
        """
        info = self.info
        max_tokens = info.max_batch_tokens
        if (
            max_tokens is not None
            and info.max_input_length is not None
            and self.batch_size * info.max_input_length <= max_tokens
        ):
            max_tokens = None
        start, size, tokens = 0, 0, 0
        for index, text in enumerate(texts):
            text_bytes = len(text.encode("utf-8")) + 8
            text_tokens = _estimate_tokens(text) if max_tokens is not None else 0
            full = index - start >= self.batch_size
            too_big = size + text_bytes > MAX_BODY_BYTES
            too_many_tokens = max_tokens is not None and tokens + text_tokens > max_tokens
            if index > start and (full or too_big or too_many_tokens):
                yield start, index
                start, size, tokens = index, 0, 0
            size += text_bytes
            tokens += text_tokens
        if start < len(texts):
            yield start, len(texts)

    def _embed_batch(self, texts: list[str], names: list[str]) -> list[EmbedResult]:
        """Embed one sized batch; an input the service finds too long is split, never cut.

        A batch goes out as it is: with production limits (thousands of tokens) nothing
        is over, and counting first would cost a /tokenize call per batch, whose answer
        (every token with its offsets) is heavier than the embeddings. When the service
        answers 422, one /tokenize call finds the over-long inputs and they are split
        where the count says, not by bisection. Once 422s are common for this corpus
        (a model with a short limit), batches are counted before they are sent; so are
        all batches to a service that would cut an over-long input rather than refuse
        it (``/v1/embeddings`` of a TEI run with ``--auto-truncate``).
        """
        with self._count_lock:
            count_first = self._count_first or self._service_truncates
            if not count_first:
                self._batches_sent += 1
        if count_first:
            return self._embed_pieces(self._presplit(texts), names)
        try:
            return self._embed_as_is(texts, names)
        except InputTooLong:
            with self._count_lock:
                self._batches_too_long += 1
                if (
                    self._batches_too_long >= 2
                    and self._batches_too_long >= _TOO_LONG_SHARE * self._batches_sent
                ):
                    self._count_first = True
        pieces = self._presplit(texts)
        if all(len(parts) == 1 for parts in pieces):  # no count to go by: bisect
            return self._embed_resilient(texts, names)
        return self._embed_pieces(pieces, names)

    def _embed_as_is(self, texts: list[str], names: list[str]) -> list[EmbedResult]:
        """One request for the batch; InputTooLong propagates, other rejections bisect."""
        formatted = [self.profile.format_passage(text) for text in texts]
        try:
            vectors = self._post_batch(formatted, documents=names)
        except InputTooLong:
            raise
        except RequestRejected as error:
            if len(texts) == 1:
                return [EmbedFailure(error)]
            middle = len(texts) // 2
            return self._embed_resilient(texts[:middle], names[:middle]) + self._embed_resilient(
                texts[middle:], names[middle:]
            )
        except UnusableEmbeddings as error:
            return _keep_usable(texts, names, error)
        return [[EmbeddedPart(text, vector)] for text, vector in zip(texts, vectors, strict=True)]

    def _embed_pieces(self, pieces: list[list[str]], names: list[str]) -> list[EmbedResult]:
        """Embed inputs given as their parts, in batches; each input's parts stay in order."""
        if all(len(parts) == 1 for parts in pieces):
            return self._embed_resilient([parts[0] for parts in pieces], names)
        flat = [(i, part) for i, parts in enumerate(pieces) for part in parts]
        results: list[EmbedResult] = [[] for _ in pieces]
        for start in range(0, len(flat), self.batch_size):
            group = flat[start : start + self.batch_size]
            outcomes = self._embed_resilient(
                [part for _, part in group], [names[i] for i, _ in group]
            )
            for (i, _), outcome in zip(group, outcomes, strict=True):
                current = results[i]
                if isinstance(current, EmbedFailure):
                    continue
                if isinstance(outcome, EmbedFailure):
                    results[i] = outcome
                else:
                    current.extend(outcome)
        return results

    def _presplit(self, texts: list[str]) -> list[list[str]]:
        """Each input, or its parts when the service's tokenizer counts it over the limit.

        Only inputs that might be too long are sent to ``/tokenize``: one that fits by
        its byte count alone is not. Parts are cut by an estimate; for a service that
        would cut rather than refuse one still over, they are counted again.
        """
        pieces = self._presplit_once(texts)
        if not self._service_truncates:
            return pieces
        split = [i for i, parts in enumerate(pieces) if len(parts) > 1]
        if split:
            counted = iter(self._presplit([part for i in split for part in pieces[i]]))
            for i in split:
                pieces[i] = [piece for _ in pieces[i] for piece in next(counted)]
        return pieces

    def _presplit_once(self, texts: list[str]) -> list[list[str]]:
        limit = self.info.max_input_length
        pieces = [[text] for text in texts]
        if not limit or not self._can_tokenize:
            return pieces
        formatted = [self.profile.format_passage(text) for text in texts]
        unsure = [
            i
            for i, text in enumerate(formatted)
            if len(text.encode("utf-8")) + _SPECIAL_TOKENS_ALLOWANCE > limit
        ]
        if not unsure:
            return pieces
        answer: list[Any] = []
        # As many inputs per request as an embedding request takes: a split's parts
        # counted again outnumber the batch they came from.
        for start in range(0, len(unsure), self.batch_size):
            part = [formatted[i] for i in unsure[start : start + self.batch_size]]
            try:
                counted = request_json(
                    self._http,
                    self._retry,
                    "POST",
                    f"{self.base_url}/tokenize",
                    json_body={"inputs": part, "add_special_tokens": True},
                )
            except RequestRejected as error:
                if error.status in (404, 405):  # a gateway without TEI's /tokenize
                    self._can_tokenize = False  # split on 422 instead
                return pieces
            if not isinstance(counted, list) or len(counted) != len(part):
                return pieces
            answer.extend(counted)
        # Aim a little under the limit: parts are cut by characters, counted by proportion.
        target = max(1, int(limit * 0.9))
        for i, tokens in zip(unsure, answer, strict=True):
            if len(tokens) > limit:
                pieces[i] = _split_to_fit(texts[i], len(tokens), target)
        return pieces

    def _embed_resilient(self, texts: list[str], names: list[str]) -> list[EmbedResult]:
        profile = self.profile
        formatted = [profile.format_passage(text) for text in texts]
        try:
            vectors = self._post_batch(formatted, documents=names)
        except InputTooLong as error:
            if len(texts) == 1:
                return [self._embed_split(texts[0], names[0], error)]
            middle = len(texts) // 2
            return self._embed_resilient(texts[:middle], names[:middle]) + self._embed_resilient(
                texts[middle:], names[middle:]
            )
        except RequestRejected as error:
            if len(texts) == 1:
                return [EmbedFailure(error)]
            middle = len(texts) // 2
            return self._embed_resilient(texts[:middle], names[:middle]) + self._embed_resilient(
                texts[middle:], names[middle:]
            )
        except UnusableEmbeddings as error:
            return _keep_usable(texts, names, error)
        return [[EmbeddedPart(text, vector)] for text, vector in zip(texts, vectors, strict=True)]

    def _embed_split(self, text: str, name: str, error: InputTooLong) -> EmbedResult:
        from quarry.chunking import split_in_two

        if len(text) < 2:
            return EmbedFailure(error)
        parts: list[EmbeddedPart] = []
        for piece in split_in_two(text):
            result = self._embed_resilient([piece], [name])[0]
            if isinstance(result, EmbedFailure):
                return result
            parts.extend(result)
        return parts

    def _pacer(self) -> Pacer:
        with self._pool_lock:
            if self._pace is None:
                self._pace = Pacer(self.concurrency, self._timeout)
            return self._pace

    def _post_batch(
        self, texts: list[str], documents: Sequence[str], *, unit: bool = True
    ) -> npt.NDArray[np.float32]:
        """One embedding request, paced (see quarry._pacing): a request that timed out
        behind others is sent again with fewer in flight."""
        pacer = self._pacer()
        cancelled = self._cancelled  # cancel_pending() puts a fresh one in its place
        alone_before = False  # this batch already timed out once with no other in flight
        while True:
            with pacer.slot() as depth:
                with self._count_lock:
                    self.requests_sent += 1
                started = time.monotonic()
                try:
                    if self.dialect == "tei":
                        vectors = self._post_tei(texts, documents, unit)
                    else:
                        vectors = self._post_openai(texts, documents, unit)
                except TransientFailure as error:
                    if not error.timed_out:
                        raise
                    if cancelled.done():  # a stopping run: nobody waits for it to be resent
                        stopping = f"{error.url}: abandoned, the run is stopping"
                        raise CancelledError(stopping) from error
                    if not pacer.timed_out(depth):
                        if alone_before:
                            raise ServiceUnavailable(
                                error.url,
                                f"no answer within {self._timeout:g}s (QUARRY_EMBED_TIMEOUT) "
                                "to a request sent with no other in flight, twice: the "
                                "service cannot embed one batch in that time; raise "
                                "QUARRY_EMBED_TIMEOUT or lower QUARRY_EMBED_BATCH_SIZE",
                                documents=documents,
                            ) from error
                        # One stall (a pause, a lost packet) is no verdict on the service:
                        # the same batch gets one more try before the run fails.
                        alone_before = True
                        logger.warning(
                            "%s: no answer within %gs to a request sent with no other in "
                            "flight; sending it once more",
                            error.url,
                            self._timeout,
                        )
                        continue
                    logger.warning(
                        "%s: no answer within %gs with %d requests in flight: the service "
                        "is slower than that allows; sending it again with at most %d",
                        error.url,
                        self._timeout,
                        depth,
                        pacer.limit,
                    )
                    continue
            full = len(texts) >= self.batch_size
            pacer.answered(time.monotonic() - started, depth, full=full)
            return vectors

    def _post_tei(
        self, texts: list[str], documents: Sequence[str], unit: bool
    ) -> npt.NDArray[np.float32]:
        url = f"{self.base_url}/embed"
        body = request_json(
            self._http,
            self._paced_retry,
            "POST",
            url,
            json_body={"inputs": texts, "truncate": False, "normalize": True},
            documents=documents,
            dialect_hint=EMBED_ROUTE_HINT,
        )
        if not isinstance(body, list) or len(body) != len(texts):
            raise BadResponse(url, f"expected {len(texts)} embeddings", documents=documents)
        return vector_matrix(url, body, documents, unit=unit, width=self._width(unit))

    def _width(self, unit: bool) -> int | None:
        """The vector size answers must have: :attr:`dimensions` for passages; raw
        probes (the canary) are the fingerprint's to judge."""
        return self.dimensions if unit else None

    def _post_openai(
        self, texts: list[str], documents: Sequence[str], unit: bool
    ) -> npt.NDArray[np.float32]:
        url = f"{self.base_url}/v1/embeddings"

        def attempt() -> npt.NDArray[np.float32]:
            if self._openai.is_closed():
                raise CancelledError(f"{url}: abandoned, the client is closed")
            try:
                # The SDK's own embeddings.create first walks every input string through
                # its type-directed transform: ~1.5 ms of CPU per 32-input request, a
                # tenth of an ingest's client time. The body is the same.
                response = self._openai.post(
                    "/embeddings",
                    body={"model": self.model_name, "input": texts, "encoding_format": "base64"},
                    cast_to=httpx2.Response,
                )
            except openai.APITimeoutError as error:
                raise TransientFailure.timeout(
                    url, error, late=answer_late(error.__cause__)
                ) from error
            except openai.APIConnectionError as error:
                if self._openai.is_closed():
                    # Abandoned by a stopping run (stop(), then close()): the service is
                    # fine, nobody reads the answer, and a retry would only hold the
                    # process for the retry budget saying "cannot connect".
                    raise CancelledError(f"{url}: abandoned, the client is closed") from error
                raise TransientFailure.transport(url, error) from error
            except openai.APIStatusError as error:
                raise_for_status(
                    url,
                    error.status_code,
                    error.response.content,
                    error.response.headers,
                    documents=documents,
                )
                raise
            body = json_answer(url, response, documents)
            return _decode_openai(
                url, body, len(texts), documents, unit=unit, width=self._width(unit)
            )

        return call_with_retries(self._paced_retry, url, attempt, documents=documents)

    def close(self) -> None:
        """Release connections (and the threads of the shared pool)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()
        self._openai.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(future: Future[list[EmbedResult]], cancelled: Future[None]) -> list[EmbedResult]:
    """``future.result()``, unless ``cancelled`` is done first (the run is stopping): then
    CancelledError at once, and a request in flight is left to finish alone."""
    either: list[Future[Any]] = [future, cancelled]
    futures_wait(either, return_when=FIRST_COMPLETED)
    if not future.done():
        raise CancelledError("embedding cancelled: the run is stopping")
    return future.result()


def _keep_usable(
    texts: Sequence[str], names: Sequence[str], error: UnusableEmbeddings
) -> list[EmbedResult]:
    """The inputs of a batch some of whose embeddings were bad: each bad one fails alone."""
    return [
        [EmbeddedPart(text, vector)] if vector is not None else error.failure(name)
        for text, name, vector in zip(texts, names, error.vectors, strict=True)
    ]


def _decode_openai(
    url: str,
    body: Any,
    expected: int,
    documents: Sequence[str],
    *,
    unit: bool = True,
    width: int | None = None,
) -> npt.NDArray[np.float32]:
    """Vectors from an OpenAI-style body, float lists or base64 little-endian float32."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != expected:
        raise BadResponse(url, f"expected {expected} embeddings in 'data'", documents=documents)
    rows: list[Any] = [None] * expected
    for position, item in enumerate(data):
        if not isinstance(item, dict):
            raise BadResponse(url, f"malformed embedding item {item!r:.80}", documents=documents)
        index = item.get("index", position)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < expected:
            raise BadResponse(url, f"malformed embedding index {index!r:.40}", documents=documents)
        embedding = item.get("embedding")
        if isinstance(embedding, str):
            try:
                rows[index] = np.frombuffer(base64.b64decode(embedding), dtype="<f4")
            except (ValueError, binascii.Error):
                rows[index] = None  # not base64 of float32s: that input fails alone
        else:
            rows[index] = embedding  # a list, or None and the like: that input fails alone
    return vector_matrix(url, rows, documents, unit=unit, width=width)


def vector_rows(
    url: str, rows: Sequence[Any], documents: Sequence[str] = (), *, unit: bool = True
) -> list[list[float]]:
    """:func:`vector_matrix` as lists of floats (a query's vector, a probe's)."""
    matrix: list[list[float]] = vector_matrix(url, rows, documents, unit=unit).tolist()
    return matrix


def vector_matrix(
    url: str,
    rows: Sequence[Any],
    documents: Sequence[str] = (),
    *,
    unit: bool = True,
    width: int | None = None,
) -> npt.NDArray[np.float32]:
    """``rows`` (float lists or arrays, one per input) as a float32 matrix, each row
    scaled to unit length when ``unit``.

    A row that is missing, not a list of numbers, of another length than the others
    (one model gives every input the same dimensions), all zeros, or holding a
    ``null``, infinite or NaN value cannot be searched: :class:`UnusableEmbeddings` then carries the
    good rows, so only the inputs whose rows are bad fail. A BadResponse naming
    ``url`` and ``documents`` when no row is usable at all, and VectorsOfAnotherSize
    when the rows are not ``width`` long (the index's size, where it is known).
    """
    if not rows:
        return np.empty((0, 0), dtype=np.float32)
    matrix: npt.NDArray[np.float32] | None
    try:
        matrix = np.asarray(rows, dtype=np.float32)
        if matrix.ndim != 2:
            raise ValueError(f"{matrix.ndim} dimensions")
    except (TypeError, ValueError):
        matrix = _salvage(rows)
    if matrix is None:
        raise BadResponse(
            url, "no embedding in the answer is a list of numbers", documents=documents
        )
    if width is not None and matrix.shape[1] != width:
        # Review: a whole batch of another size reached Qdrant, which was blamed for it.
        raise VectorsOfAnotherSize(
            url,
            f"answered vectors of {matrix.shape[1]} dimensions, where the model's have {width}",
            documents=documents,
        )
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    # A zero vector has no direction: it scores 0 against every query, so a chunk stored
    # with one could never be found (and an unchanged file is not read again to mend it).
    usable: list[bool] = (
        (np.isfinite(matrix).sum(axis=1) == matrix.shape[1]) & (norms[:, 0] > 0)
    ).tolist()
    if unit:
        np.divide(matrix, norms, out=matrix, where=np.isfinite(norms) & (norms > 0))
    if not all(usable):
        raise UnusableEmbeddings(url, list(matrix), usable, documents)
    return matrix


def _salvage(rows: Sequence[Any]) -> npt.NDArray[np.float32] | None:
    """Rows as a matrix of the length most of them have; any other row all NaN."""
    vectors: list[npt.NDArray[np.float32] | None] = []
    for row in rows:
        try:
            vector = np.asarray(row, dtype=np.float32)
        except (TypeError, ValueError):
            vector = None
        vectors.append(vector if vector is not None and vector.ndim == 1 else None)
    lengths = Counter(len(v) for v in vectors if v is not None and len(v))
    if not lengths:
        return None
    dims = lengths.most_common(1)[0][0]
    matrix = np.full((len(rows), dims), np.nan, dtype=np.float32)
    for i, vector in enumerate(vectors):
        if vector is not None and len(vector) == dims:
            matrix[i] = vector
    return matrix


class UnusableEmbeddings(BadResponse):
    """Some embeddings of a batch are missing, malformed, or hold a non-finite value.

    ``vectors`` has the batch's other vectors in place (a bad one as None), so the
    inputs the service answered well are kept and only the bad ones fail, each as a
    BadResponse naming its own document (:meth:`failure`).
    """

    def __init__(
        self,
        url: str,
        vectors: Sequence[Vector],
        usable: list[bool],
        documents: Sequence[str] = (),
    ) -> None:
        super().__init__(url, _UNUSABLE, documents=documents)
        self.vectors: list[Vector | None] = [
            vector if ok else None for vector, ok in zip(vectors, usable, strict=True)
        ]

    def failure(self, document: str) -> EmbedFailure:
        """The failure of one bad input, naming ``document``."""
        return EmbedFailure(
            BadResponse(self.url, _UNUSABLE, documents=[document] if document else [])
        )


_UNUSABLE = (
    "the service's embedding for it is unusable: missing, not a vector of the model's "
    "dimensions, all zeros, or holding a null, infinite or NaN value"
)


def _estimate_tokens(text: str) -> int:
    """A deliberately generous token estimate for batch sizing (tiktoken plus a margin)."""
    from quarry.chunking import count_tokens

    return int(count_tokens(text) * 1.3) + 2


def _split_to_fit(text: str, tokens: int, target: int) -> list[str]:
    """Halve ``text`` at its strongest boundaries until each part's share of ``tokens``
    (estimated by characters) fits ``target``; the parts join back to ``text``."""
    from quarry.chunking import split_in_two

    if tokens <= target or len(text) < 2:
        return [text]
    first, second = split_in_two(text)
    per_char = tokens / len(text)
    return _split_to_fit(first, math.ceil(len(first) * per_char), target) + _split_to_fit(
        second, math.ceil(len(second) * per_char), target
    )
