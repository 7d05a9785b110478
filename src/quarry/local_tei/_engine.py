"""TEI's router core as a performance model: permits per input, one queue, one worker.

TEI takes a concurrency permit for every input without waiting (none free: 429),
queues the tokenized inputs, and a single batching loop takes as many queued
inputs as fit ``max_batch_tokens`` into each forward pass, whichever requests they
came from. A step here costs ``latency_ms + per_token_us * tokens`` (slept on the
event loop) on top of the backend's own compute, which runs in a worker thread for
the real model so that the event loop keeps accepting requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ._backends import Backend, EmbedJob, Job, StepResult
from ._config import LocalTEIConfig
from ._protocol import TEIError
from ._stats import ServerStats

__all__ = ["Done", "Engine"]


@dataclass(frozen=True, slots=True)
class Done:
    """A job's result with its time in the queue and in its step, in seconds."""

    result: StepResult
    queue_s: float
    inference_s: float


class _Request:
    """The jobs of one request: one future, resolved when the last job is done."""

    __slots__ = ("future", "remaining", "results")

    def __init__(self, future: asyncio.Future[list[Done]], n: int) -> None:
        self.future = future
        self.remaining = n
        self.results: list[Done | None] = [None] * n


@dataclass(slots=True, eq=False)
class _Pending:
    job: Job
    request: _Request
    index: int
    enqueued: float


class Engine:
    """Concurrency permits, the queue and the worker loop of one service."""

    def __init__(self, backend: Backend, config: LocalTEIConfig, stats: ServerStats) -> None:
        self._backend = backend
        self._stats = stats
        self._max_in_flight = config.max_concurrent_requests
        self._max_batch_tokens = config.max_batch_tokens
        self._fixed_s = config.latency_ms / 1e3
        self._per_token_s = config.per_token_us / 1e6
        self._in_flight = 0
        self._queue: deque[_Pending] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        """Inputs holding a permit now."""
        return self._in_flight

    def _bind(self) -> asyncio.AbstractEventLoop:
        # The app may be driven by more than one event loop over its life (tests run
        # it through an ASGI transport under several asyncio.run calls): state that
        # belongs to a finished loop is dropped.
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._queue.clear()
            self._in_flight = 0
            self._wake = asyncio.Event()
            self._task = None
        return loop

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` permits at once, or none (TEI: one per input, released on failure)."""
        self._bind()
        if self._in_flight + n > self._max_in_flight:
            return False
        self._in_flight += n
        self._stats.record_in_flight(self._in_flight)
        return True

    def release(self, n: int) -> None:
        """Give back permits of inputs that will not be queued."""
        self._in_flight = max(0, self._in_flight - n)

    async def run(self, jobs: Sequence[Job]) -> list[Done]:
        """Queue jobs whose permits are held; the worker releases each permit when done."""
        loop = self._bind()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._work(), name="local-tei-worker")
        if not jobs:
            return []
        now = loop.time()
        future: asyncio.Future[list[Done]] = loop.create_future()
        request = _Request(future, len(jobs))
        self._queue.extend(_Pending(job, request, i, now) for i, job in enumerate(jobs))
        assert self._wake is not None
        self._wake.set()
        return await future

    async def aclose(self) -> None:
        """Stop the worker; queued jobs fail as Unhealthy."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while self._queue:
            self._fail(self._queue.popleft(), TEIError("Unhealthy", "shutting down"))

    def _fail(self, pending: _Pending, error: Exception) -> None:
        self.release(1)
        if not pending.request.future.done():
            pending.request.future.set_exception(error)

    def _next_batch(self) -> tuple[list[_Pending], int]:
        batch: list[_Pending] = []
        tokens = 0
        queue = self._queue
        while queue:
            head = queue[0]
            if head.request.future.done():  # the request went away or already failed
                queue.popleft()
                self.release(1)
                continue
            if batch and tokens + head.job.n_tokens > self._max_batch_tokens:
                break
            queue.popleft()
            batch.append(head)
            tokens += head.job.n_tokens
        return batch, tokens

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            while not self._queue:
                wake.clear()
                await wake.wait()
            batch, tokens = self._next_batch()
            if not batch:
                continue
            started = loop.time()
            jobs = [p.job for p in batch]
            try:
                if self._backend.blocking:
                    results = await loop.run_in_executor(None, self._backend.run, jobs)
                else:
                    results = self._backend.run(jobs)
                # Even a free step yields, so that requests keep being accepted.
                await asyncio.sleep(self._fixed_s + self._per_token_s * tokens)
            except asyncio.CancelledError:
                for pending in batch:
                    self._fail(pending, TEIError("Unhealthy", "shutting down"))
                raise
            except Exception as exc:  # a backend failure is TEI's 424, not a dead worker
                error = TEIError("Backend", f"Backend error: Inference Error: {exc}")
                for pending in batch:
                    self._fail(pending, error)
                continue
            finished = loop.time()
            embedded = sum(1 for job in jobs if isinstance(job, EmbedJob))
            self._stats.record_step(embedded=embedded, reranked=len(jobs) - embedded, tokens=tokens)
            for pending, result in zip(batch, results, strict=True):
                self.release(1)
                request = pending.request
                if request.future.done():
                    continue
                request.results[pending.index] = Done(
                    result, started - pending.enqueued, finished - started
                )
                request.remaining -= 1
                if request.remaining == 0:
                    request.future.set_result([d for d in request.results if d is not None])
