"""Async twins of the service clients, for the query API.

The API is async end to end: :class:`AsyncEmbeddingClient` embeds through
``openai.AsyncOpenAI`` (or TEI's ``/embed``), :class:`AsyncRerankClient` posts to
``/rerank`` (or the Cohere-style ``/v1/rerank``) with ``httpx2.AsyncClient``, and
:class:`AsyncStore` reads Qdrant through ``AsyncQdrantClient`` (a server) or
:class:`ThreadedLocalQdrant` (local mode, off the event loop).

They share everything but the I/O with the sync clients: the retry policy
(:class:`quarry._http.RetryPolicy`, driven by tenacity's ``AsyncRetrying``), the
status mapping (:func:`quarry._http.raise_for_status`), the response parsing of
:mod:`quarry.embeddings` and :mod:`quarry.rerank`, the prompt profiles and the
fingerprint construction. The query path only reads, so the store has no writes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import httpx2
import openai
import tenacity
from qdrant_client import AsyncQdrantClient, QdrantClient, models

from quarry._http import (
    RetryPolicy,
    TransientFailure,
    async_http_client,
    gave_up,
    info_timeout,
    json_answer,
    raise_for_status,
)
from quarry.config import DEFAULT_QUERY_TASK, Settings, make_data_folder
from quarry.embeddings import (
    DEFAULT_BATCH_SIZE,
    EMBED_ROUTE_HINT,
    EmbedDialect,
    ServiceInfo,
    _decode_openai,
    embed_dialect,
    vector_rows,
)
from quarry.errors import BadResponse, InputTooLong, RequestRejected, ServiceUnavailable
from quarry.fingerprint import CANARY_TEXT, Fingerprint, build_fingerprint
from quarry.prompts import ProfileName, PromptProfile, profile_for_model
from quarry.rerank import (
    _HINT,
    DEFAULT_RERANK_BATCH,
    MAX_SPLIT_DEPTH,
    RerankDialect,
    _parse_scores,
    query_too_long,
)
from quarry.store import (
    LOCAL_STORAGE_ERRORS,
    META_FINGERPRINT,
    SEARCH_FIELDS,
    CollectionInfo,
    local_mode_locked,
    local_mode_unreadable,
    unit_vector,
)

T = TypeVar("T")

# Keep-alive connections per client: enough for the API's concurrency without a new
# TCP handshake per request.
_LIMITS = httpx2.Limits(max_connections=256, max_keepalive_connections=64)


# -- inputs in flight ------------------------------------------------------------------------


class InputSlots:
    """At most ``limit`` inputs in flight to one service; callers over it wait their turn.

    TEI takes a concurrency permit per input and answers 429 at once when none is
    free (``max_concurrent_requests`` in ``/info``): 80 queries reranking 50
    candidates each would be 4,000 inputs against TEI's default 512. Waiting here,
    first come first served, keeps a busy but healthy service from looking down.
    """

    def __init__(self) -> None:
        self._in_flight = 0
        self._waiting: collections.deque[tuple[int, int, asyncio.Future[None]]] = (
            collections.deque()
        )

    @contextlib.asynccontextmanager
    async def hold(
        self, count: int, limit: int | None, *, url: str, wait_s: float
    ) -> AsyncIterator[None]:
        """Hold ``count`` slots (at most ``limit``, all of them for a larger request)
        while the block runs; no ``limit`` (a service without ``/info``) holds none.

        Waits at most ``wait_s`` (the caller's retry budget: TEI's 429 would have cost
        as much) for room, then raises ServiceUnavailable (status 429) naming ``url``.
        """
        if not limit or count <= 0:
            yield
            return
        count = min(count, limit)
        if self._waiting or self._in_flight + count > limit:
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (count, limit, granted)
            self._waiting.append(entry)
            try:
                async with asyncio.timeout(wait_s):
                    await granted
            except TimeoutError:
                raise ServiceUnavailable(
                    url,
                    f"busy: {self._in_flight} inputs in flight, as many as its "
                    f"max_concurrent_requests ({limit}) allows; waited {wait_s:g}s for room",
                    status=429,
                ) from None
            except BaseException:
                if granted.done() and not granted.cancelled():
                    self._release(count)  # granted as it was cancelled: give it back
                else:
                    with contextlib.suppress(ValueError):  # _grant may have dropped it
                        self._waiting.remove(entry)
                    self._grant()
                raise
        else:
            self._in_flight += count
        try:
            yield
        finally:
            self._release(count)

    def _release(self, count: int) -> None:
        self._in_flight -= count
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            count, limit, granted = self._waiting[0]
            if granted.done():  # its waiter was cancelled and has not run yet
                self._waiting.popleft()
                continue
            if self._in_flight + count > limit:
                return
            self._waiting.popleft()
            self._in_flight += count
            granted.set_result(None)


# -- retries and one exchange ---------------------------------------------------------------


def async_retrying(policy: RetryPolicy) -> tenacity.AsyncRetrying:
    """``policy`` as an async tenacity controller: the same retry, stop and wait rules."""
    template = policy.retrying()
    return tenacity.AsyncRetrying(
        retry=template.retry,
        stop=template.stop,
        wait=template.wait,
        reraise=True,
        before_sleep=template.before_sleep,
    )


async def acall_with_retries(
    policy: RetryPolicy,
    url: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    documents: Sequence[str] = (),
) -> T:
    """Await ``attempt`` under ``policy``; a spent budget raises ServiceUnavailable for the url."""
    retrying = async_retrying(policy)
    started = time.monotonic()
    try:
        return await retrying(attempt)
    except TransientFailure as error:
        if policy.on_retry is not None:
            policy.on_retry(error)
        raise ServiceUnavailable(
            url,
            gave_up(policy, retrying.statistics, started, error),
            status=error.status,
            documents=documents,
        ) from error


async def asend(
    client: httpx2.AsyncClient,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    dialect_hint: str | None = None,
) -> httpx2.Response:
    """One HTTP exchange, with transport errors and 5xx/429 classified as transient."""
    try:
        response = await client.request(method, url, json=json_body)
    except httpx2.TimeoutException as error:
        raise TransientFailure.timeout(url, error) from error
    except httpx2.TransportError as error:
        raise TransientFailure.transport(url, error) from error
    raise_for_status(
        url, response.status_code, response.content, response.headers, dialect_hint=dialect_hint
    )
    return response


async def arequest_json(
    client: httpx2.AsyncClient,
    policy: RetryPolicy,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    dialect_hint: str | None = None,
) -> Any:
    """Send a request with retries and return its parsed JSON body."""

    async def attempt() -> Any:
        response = await asend(client, method, url, json_body=json_body, dialect_hint=dialect_hint)
        return json_answer(url, response)

    return await acall_with_retries(policy, url, attempt)


async def afetch_info(
    client: httpx2.AsyncClient, url: str, policy: RetryPolicy
) -> dict[str, Any] | None:
    """GET ``/info``; None when the service has no such route (a gateway, infinity)."""
    target = f"{url}/info"

    async def attempt() -> dict[str, Any] | None:
        try:
            response = await client.get(target, timeout=info_timeout(client.timeout, policy))
        except httpx2.TimeoutException as error:
            raise TransientFailure.timeout(target, error) from error
        except httpx2.TransportError as error:
            raise TransientFailure.transport(target, error) from error
        if response.status_code in (404, 405):
            return None
        raise_for_status(target, response.status_code, response.content, response.headers)
        body = json_answer(target, response)  # a gateway's login page is no /info
        return body if isinstance(body, dict) else None

    return await acall_with_retries(policy, target, attempt)


# -- embedding --------------------------------------------------------------------------------


class AsyncEmbeddingClient:
    """Embeds queries (and the canary) through one service, without blocking the event loop.

    Queries are formatted here by the model's prompt profile, as the sync
    :class:`quarry.embeddings.EmbeddingClient` does; nothing is split or
    truncated (an over-long input raises InputTooLong). ``transport`` is for tests.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
        timeout: float = 60.0,
        retry: RetryPolicy = RetryPolicy(),
        prompt_profile: ProfileName | None = None,
        query_task: str = DEFAULT_QUERY_TASK,
        dialect: EmbedDialect = "auto",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry
        self.query_task = query_task
        self._model = model
        self._profile_override = prompt_profile
        self._dialect = dialect
        self._http = async_http_client(
            transport=transport, timeout=timeout, api_key=api_key, limits=_LIMITS
        )
        self._openai = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or "unused",
            max_retries=0,
            timeout=timeout,
            http_client=async_http_client(transport=transport, timeout=timeout, limits=_LIMITS),
        )
        self._info: ServiceInfo | None = None
        self._info_lock = asyncio.Lock()
        self._slots = InputSlots()

    async def info(self, *, refresh: bool = False, retry: RetryPolicy | None = None) -> ServiceInfo:
        """The service's identity and limits, fetched once (again with ``refresh``)."""
        if self._info is not None and not refresh:
            return self._info
        async with self._info_lock:
            if self._info is None or refresh:
                self._info = await self._load_info(retry or self.retry)
            return self._info

    async def _load_info(self, policy: RetryPolicy) -> ServiceInfo:
        raw = await afetch_info(self._http, self.base_url, policy)
        if raw is not None and "model_id" in raw:
            return ServiceInfo.from_tei(self.base_url, raw)
        model_id = self._model or await self._model_from_listing(policy) or "unknown"
        return ServiceInfo(url=self.base_url, model_id=model_id)

    async def _model_from_listing(self, policy: RetryPolicy) -> str | None:
        try:
            listing = await arequest_json(self._http, policy, "GET", f"{self.base_url}/v1/models")
        except RequestRejected:
            return None
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            return str(data[0].get("id"))
        return None

    async def profile(self) -> PromptProfile:
        """The prompt profile in force (explicit setting, else from the model id)."""
        return profile_for_model((await self.info()).model_id, self._profile_override)

    async def embed_query(
        self, query: str, *, task: str | None = None, retry: RetryPolicy | None = None
    ) -> list[float]:
        """Embed a search query formatted by the profile with ``task`` (default: the client's)."""
        text = (await self.profile()).format_query(query, task or self.query_task)
        return (await self._post([text], retry or self.retry))[0]

    async def embed_raw(
        self, texts: Sequence[str], *, retry: RetryPolicy | None = None
    ) -> list[list[float]]:
        """Embed texts exactly as given (probes, the canary), one request per batch; the
        vectors are the service's own, not scaled (the fingerprint reads normalisation)."""
        size = (await self.info()).inputs_per_request(DEFAULT_BATCH_SIZE)
        out: list[list[float]] = []
        for start in range(0, len(texts), size):
            batch = list(texts[start : start + size])
            out.extend(await self._post(batch, retry or self.retry, unit=False))
        return out

    async def read_fingerprint(self, *, retry: RetryPolicy | None = None) -> Fingerprint:
        """The live service's fingerprint, read afresh: ``/info`` plus the canary vector."""
        info = await self.info(refresh=True, retry=retry)
        profile = profile_for_model(info.model_id, self._profile_override)
        canary = (await self.embed_raw([profile.format_passage(CANARY_TEXT)], retry=retry))[0]
        return build_fingerprint(info, canary, profile.name, self.query_task)

    async def _post(
        self, texts: list[str], policy: RetryPolicy, *, unit: bool = True
    ) -> list[list[float]]:
        info = await self.info(retry=policy)
        limit = info.max_concurrent_requests
        async with self._slots.hold(len(texts), limit, url=self.base_url, wait_s=policy.budget):
            # As EmbeddingClient.dialect: a TEI that would cut an over-long query is asked
            # on /embed, which refuses it (422, "too long": the client is told).
            if embed_dialect(self._dialect, info) == "tei":
                return await self._post_tei(texts, policy, unit)
            return await self._post_openai(texts, policy, unit)

    async def _post_tei(
        self, texts: list[str], policy: RetryPolicy, unit: bool
    ) -> list[list[float]]:
        url = f"{self.base_url}/embed"
        body = await arequest_json(
            self._http,
            policy,
            "POST",
            url,
            json_body={"inputs": texts, "truncate": False, "normalize": True},
            dialect_hint=EMBED_ROUTE_HINT,
        )
        if not isinstance(body, list) or len(body) != len(texts):
            raise BadResponse(url, f"expected {len(texts)} embeddings")
        return vector_rows(url, body, unit=unit)

    async def _post_openai(
        self, texts: list[str], policy: RetryPolicy, unit: bool
    ) -> list[list[float]]:
        url = f"{self.base_url}/v1/embeddings"
        model = self._model or (await self.info()).model_id

        async def attempt() -> list[list[float]]:
            try:
                response = await self._openai.embeddings.with_raw_response.create(
                    model=model, input=texts, encoding_format="base64"
                )
            except openai.APITimeoutError as error:
                raise TransientFailure.timeout(url, error) from error
            except openai.APIConnectionError as error:
                raise TransientFailure.transport(url, error) from error
            except openai.APIStatusError as error:
                raise_for_status(
                    url, error.status_code, error.response.content, error.response.headers
                )
                raise
            body = json_answer(url, response.http_response)
            vectors: list[list[float]] = _decode_openai(
                url, body, len(texts), (), unit=unit
            ).tolist()
            return vectors

        return await acall_with_retries(policy, url, attempt)

    async def aclose(self) -> None:
        """Release connections."""
        await self._http.aclose()
        await self._openai.close()


# -- rerank ----------------------------------------------------------------------------------


class AsyncRerankClient:
    """Scores (query, passage) pairs through a reranking service, batches in parallel.

    Like the sync :class:`quarry.rerank.RerankClient`: batches of at most the
    service's ``max_client_batch_size``, and a passage too long for the reranker is
    split and scored by its best part, never truncated.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
        timeout: float = 60.0,
        retry: RetryPolicy = RetryPolicy(),
        dialect: RerankDialect = "auto",
        batch_size: int | None = None,
        model: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry
        self._dialect = dialect
        self._batch_size = batch_size
        self._model = model
        self._http = async_http_client(
            transport=transport, timeout=timeout, api_key=api_key, limits=_LIMITS
        )
        self._info: ServiceInfo | None = None
        self._info_loaded = False
        self._info_fetch: asyncio.Future[None] | None = None
        self._slots = InputSlots()

    async def info(self, *, retry: RetryPolicy | None = None) -> ServiceInfo | None:
        """TEI ``/info`` of the reranker (fetched once), or None when it has none.

        Concurrent callers share one fetch (under the first caller's ``retry``), so a
        reranker that is down costs them one retry budget together, not one each.
        """
        if self._info_loaded:
            return self._info
        fetch = self._info_fetch
        if fetch is None:
            fetch = self._info_fetch = asyncio.ensure_future(self._load_info(retry or self.retry))
            fetch.add_done_callback(self._info_fetched)
        await asyncio.shield(fetch)
        return self._info

    def _info_fetched(self, fetch: asyncio.Future[None]) -> None:
        # Runs even when no caller waits any more (their queries ran out of time), so a
        # failure is read, not logged as never retrieved, and not kept: a later call
        # tries again.
        if (fetch.cancelled() or fetch.exception() is not None) and self._info_fetch is fetch:
            self._info_fetch = None

    async def _load_info(self, retry: RetryPolicy) -> None:
        raw = await afetch_info(self._http, self.base_url, retry)
        if raw is not None and "model_id" in raw:
            self._info = ServiceInfo.from_tei(self.base_url, raw)
        self._info_loaded = True

    async def dialect(self, *, retry: RetryPolicy | None = None) -> Literal["tei", "cohere"]:
        """The API in use: as set, else TEI when ``/info`` answers, else Cohere-style."""
        if self._dialect != "auto":
            return self._dialect
        return "tei" if await self.info(retry=retry) is not None else "cohere"

    async def batch_size(self, *, retry: RetryPolicy | None = None) -> int:
        """Texts per request (rerank texts count against ``max_client_batch_size``)."""
        info = await self.info(retry=retry)
        limit = info.inputs_per_request(DEFAULT_RERANK_BATCH) if info else DEFAULT_RERANK_BATCH
        return min(limit, self._batch_size) if self._batch_size else limit

    async def probe(self, *, retry: RetryPolicy | None = None) -> None:
        """Check that the reranker answers: one tiny scoring request."""
        await self._post("ping", ["ping"], retry or self.retry)

    async def score(
        self, query: str, texts: Sequence[str], *, retry: RetryPolicy | None = None
    ) -> list[float]:
        """One relevance score per text, in the order given; batches are sent concurrently.

        A text too long beside the query is scored in parts (its best part counts);
        a query too long on its own raises QueryTooLong at once.
        """
        policy = retry or self.retry
        size = await self.batch_size(retry=policy)
        batches = [list(texts[start : start + size]) for start in range(0, len(texts), size)]
        guard = _QueryGuard(self, query, policy)
        if len(batches) == 1:
            return await self._score_resilient(query, batches[0], policy, guard)
        tasks = [
            asyncio.ensure_future(self._score_resilient(query, batch, policy, guard))
            for batch in batches
        ]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            # One batch failed (or the query was cancelled): the others' answers are no
            # use now, and they would go on queueing for slots and retrying.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [score for part in parts for score in part]

    async def _score_resilient(
        self, query: str, texts: list[str], policy: RetryPolicy, guard: _QueryGuard, depth: int = 0
    ) -> list[float]:
        try:
            return await self._post(query, texts, policy)
        except InputTooLong as error:
            await guard.check()
            if len(texts) > 1:
                middle = len(texts) // 2
                return await self._score_resilient(
                    query, texts[:middle], policy, guard, depth
                ) + await self._score_resilient(query, texts[middle:], policy, guard, depth)
            return [await self._score_split(query, texts[0], error, policy, guard, depth)]

    async def _score_split(
        self,
        query: str,
        text: str,
        error: InputTooLong,
        policy: RetryPolicy,
        guard: _QueryGuard,
        depth: int,
    ) -> float:
        from quarry.chunking import split_in_two

        if len(text) < 2 or depth >= MAX_SPLIT_DEPTH:
            raise error
        return max(
            [
                (await self._score_resilient(query, [part], policy, guard, depth + 1))[0]
                for part in split_in_two(text)
            ]
        )

    async def _post(self, query: str, texts: list[str], policy: RetryPolicy) -> list[float]:
        if not texts:
            return []
        try:
            return await self._post_once(query, texts, policy)
        except InputTooLong:
            raise
        except (ServiceUnavailable, RequestRejected, BadResponse):
            # The reranker may have been restarted with other limits (a smaller batch,
            # fewer requests in flight): read its /info again next time.
            if self._info_fetch is None or self._info_fetch.done():
                self._info_loaded, self._info_fetch = False, None
            raise

    async def _post_once(self, query: str, texts: list[str], policy: RetryPolicy) -> list[float]:
        dialect = await self.dialect(retry=policy)
        if dialect == "tei":
            url = f"{self.base_url}/rerank"
            body: dict[str, Any] = {
                "query": query,
                "texts": texts,
                "truncate": False,
                "raw_scores": False,
            }
        else:
            url = f"{self.base_url}/v1/rerank"
            body = {"query": query, "documents": texts, "top_n": len(texts)}
            if self._model:
                body["model"] = self._model
        info = await self.info(retry=policy)
        limit = info.max_concurrent_requests if info else None
        async with self._slots.hold(len(texts), limit, url=url, wait_s=policy.budget):
            answer = await arequest_json(
                self._http, policy, "POST", url, json_body=body, dialect_hint=_HINT[dialect]
            )
        return _parse_scores(url, answer, len(texts))

    async def aclose(self) -> None:
        """Release connections."""
        await self._http.aclose()


class _QueryGuard:
    """Checks once per scoring, on its first InputTooLong, that the query fits on its own."""

    def __init__(self, client: AsyncRerankClient, query: str, policy: RetryPolicy) -> None:
        self._client = client
        self._query = query
        self._policy = policy
        self._checked: asyncio.Future[None] | None = None

    async def check(self) -> None:
        """Raise QueryTooLong when the query does not fit beside a one-character text."""
        if self._checked is None:
            self._checked = asyncio.ensure_future(self._check())
            # Read its outcome even if the scoring stops waiting (its query ran out of time).
            self._checked.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.shield(self._checked)

    async def _check(self) -> None:
        try:
            await self._client._post(self._query, ["."], self._policy)
        except InputTooLong as error:
            raise query_too_long(error) from None


# -- Qdrant (read side) -----------------------------------------------------------------------


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


LOCAL_SEARCH_THREADS = max(1, min(4, usable_cpus()))
"""Local-mode searches run at once: one per CPU, up to 4. Each is a matrix-vector
product that releases the GIL (4 ms at 20,000 x 384 on one BLAS thread), then about
1.4 ms of Python that holds it: past 4, searches would only queue for the GIL."""


class ThreadedLocalQdrant:
    """Local-mode Qdrant for async code, read-only: the sync client, called on threads.

    ``AsyncQdrantClient``'s local mode runs its brute-force search inside the
    coroutine, so every search held up the event loop (a ``/healthz`` waited for
    it). Here one thread owns the client (it opens and closes it, and answers the
    questions about collections), and searches run on up to
    :data:`LOCAL_SEARCH_THREADS` threads of their own, several at once. With one
    search thread, searches queued behind each other while CPUs stood idle:
    ``quarry api`` answered 127 queries/s at concurrency 16 on 2 CPUs, 151 with two
    (bench/query_latency.py).

    Local mode is not safe for concurrent writes; nothing here writes, and a
    dot-product search changes nothing (read in qdrant-client 1.16 to 1.20): it reads
    the vectors and payloads in memory, never the SQLite file, and builds its answer
    from new objects. A cosine search does change state: it divides the stored
    vectors by their norms in place, which two searches at once would do twice. So a
    collection made for cosine (by an earlier quarry) is searched on the owning
    thread, one search at a time, as before. So is a filtered search: local mode
    tests the filter against every payload in Python, holding the GIL (about 0.3 s
    at 20,000 points), so two at once finish no sooner and only keep the event loop
    waiting longer (its lag doubled in a test).
    """

    def __init__(self, path: str, *, search_threads: int = LOCAL_SEARCH_THREADS) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quarry-qdrant")
        self._searches = ThreadPoolExecutor(
            max_workers=search_threads, thread_name_prefix="quarry-qdrant-search"
        )
        # Built on the thread that closes it: SQLite may refuse a connection used from
        # another thread than its creator's (check_same_thread).
        try:
            self._client = self._thread.submit(QdrantClient, path=path).result()
            # Fixed while this client lives: no other process opens the folder, and
            # this one writes nothing.
            self._one_at_a_time = self._thread.submit(self._cosine_names).result()
        except BaseException:
            self._thread.shutdown(wait=False)
            self._searches.shutdown(wait=False)
            raise

    def _cosine_names(self) -> frozenset[str]:
        """The collections searched by cosine, and the aliases that point at them."""
        names: set[str] = set()
        for description in self._client.get_collections().collections:
            vectors = self._client.get_collection(description.name).config.params.vectors
            params = vectors.values() if isinstance(vectors, dict) else [vectors]
            if any(p is not None and p.distance == models.Distance.COSINE for p in params):
                names.add(description.name)
        for alias in self._client.get_aliases().aliases:
            if alias.collection_name in names:
                names.add(alias.alias_name)
        return frozenset(names)

    async def _run(self, call: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(call, *args, **kwargs))

    async def get_aliases(self) -> models.CollectionsAliasesResponse:
        """Every alias and the collection it points at."""
        return await self._run(self._client.get_aliases)

    async def get_collection(self, collection_name: str) -> models.CollectionInfo:
        """One collection's configuration."""
        return await self._run(self._client.get_collection, collection_name)

    async def get_collections(self) -> models.CollectionsResponse:
        """Every collection."""
        return await self._run(self._client.get_collections)

    async def collection_exists(self, collection_name: str) -> bool:
        """Whether a collection (not an alias) of that name exists."""
        return await self._run(self._client.collection_exists, collection_name)

    async def count(self, collection_name: str, *, exact: bool = True) -> models.CountResult:
        """How many points a collection holds."""
        return await self._run(self._client.count, collection_name, exact=exact)

    async def query_points(
        self,
        collection_name: str,
        *,
        query: list[float],
        limit: int,
        query_filter: models.Filter | None,
        with_payload: bool | list[str],
    ) -> models.QueryResponse:
        """The nearest points, on a search thread (several may run at once), or on
        the owning thread for a filtered search or a collection searched by cosine."""
        search = functools.partial(
            self._client.query_points,
            collection_name,
            query=query,
            limit=limit,
            query_filter=query_filter,
            with_payload=with_payload,
        )
        alone = query_filter is not None or collection_name in self._one_at_a_time
        threads = self._thread if alone else self._searches
        return await asyncio.get_running_loop().run_in_executor(threads, search)

    async def close(self) -> None:
        """Close the client (releasing the folder's lock) once the searches under way
        end, and stop its threads. Once begun, the closing goes on if the caller is
        cancelled."""
        try:
            closing = self._thread.submit(self._close_after_searches)
            await asyncio.shield(asyncio.wrap_future(closing))
        finally:
            self._thread.shutdown(wait=False)

    def _close_after_searches(self) -> None:
        self._searches.shutdown(wait=True)
        self._close_here()

    def _close_here(self) -> None:
        client = self._client
        del self._client
        client.close()
        # The last reference is dropped on this thread too, where qdrant-client's
        # __del__ closes the connection once more.


AsyncQdrant = AsyncQdrantClient | ThreadedLocalQdrant
"""What :class:`AsyncStore` reads through: a server's async client, or local mode on a thread."""


def open_async_qdrant(settings: Settings) -> AsyncQdrant:
    """An async Qdrant client: a server when ``QUARRY_QDRANT_URL`` is set, else local mode.

    Local mode admits one process: a folder another process holds raises StoreLocked.
    """
    if settings.qdrant_url:
        key = settings.qdrant_api_key.get_secret_value() if settings.qdrant_api_key else None
        return AsyncQdrantClient(url=settings.qdrant_url, api_key=key, timeout=60)
    make_data_folder(settings.data_dir, settings.qdrant_path, "local-mode Qdrant")
    try:
        return ThreadedLocalQdrant(str(settings.qdrant_path))
    except RuntimeError as error:
        if "already accessed" in str(error):
            raise local_mode_locked(settings) from error
        raise
    except LOCAL_STORAGE_ERRORS as error:
        raise local_mode_unreadable(settings, error) from error


class AsyncStore:
    """What the query path reads from Qdrant for one alias."""

    def __init__(self, client: AsyncQdrant, alias: str) -> None:
        self.client = client
        self.alias = alias

    async def resolve(self) -> str | None:
        """The physical collection behind the alias, or None when there is none."""
        for alias in (await self.client.get_aliases()).aliases:
            if alias.alias_name == self.alias:
                return alias.collection_name
        return None

    async def names_a_collection(self) -> bool:
        """Whether the alias's name is a physical collection's (set by mistake)."""
        return bool(await self.client.collection_exists(self.alias))

    async def metadata(self, physical: str) -> dict[str, Any]:
        """A physical collection's metadata (empty when it has none)."""
        return (await self.describe(physical))[0]

    async def describe(self, physical: str) -> tuple[dict[str, Any], int | None]:
        """A physical collection's metadata and the size of its (unnamed) dense vectors."""
        config = (await self.client.get_collection(physical)).config
        vectors = config.params.vectors
        size = vectors.size if isinstance(vectors, models.VectorParams) else None
        return dict(config.metadata or {}), size

    async def search(
        self, vector: Sequence[float], limit: int, query_filter: models.Filter | None = None
    ) -> list[models.ScoredPoint]:
        """Nearest points by cosine, searched through the alias (Qdrant resolves it)."""
        response = await self.client.query_points(
            self.alias,
            query=unit_vector(vector),
            limit=limit,
            query_filter=query_filter,
            with_payload=SEARCH_FIELDS,
        )
        return response.points

    async def collections(self) -> list[CollectionInfo]:
        """Every physical collection that belongs to this alias, newest first."""
        aliases: dict[str, list[str]] = {}
        for alias in (await self.client.get_aliases()).aliases:
            aliases.setdefault(alias.collection_name, []).append(alias.alias_name)
        found: list[CollectionInfo] = []
        for description in (await self.client.get_collections()).collections:
            name = description.name
            if not name.startswith(f"{self.alias}__") and self.alias not in aliases.get(name, []):
                continue
            found.append(
                CollectionInfo(
                    name=name,
                    aliases=tuple(aliases.get(name, [])),
                    points=(await self.client.count(name, exact=True)).count,
                    metadata=await self.metadata(name),
                )
            )
        return sorted(found, key=lambda info: info.name.rsplit("__", 1)[-1], reverse=True)

    async def close(self) -> None:
        """Close the client (releases local mode's folder lock)."""
        await self.client.close()


def stored_fingerprint(metadata: Mapping[str, Any]) -> Fingerprint | None:
    """The fingerprint in a collection's metadata, or None for one quarry did not create."""
    data = metadata.get(META_FINGERPRINT)
    return Fingerprint.from_metadata(data) if data else None
