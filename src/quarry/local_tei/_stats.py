"""Thread-safe counters of what a local TEI service did, for tests and benchmarks."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["ServerStats"]


class ServerStats:
    """Counters a running service updates and tests read, safe to use from any thread.

    ``requests`` counts every HTTP request by ``(method, path)``, ``responses`` every
    response by status code. ``inputs_embedded`` counts inputs of ``/embed`` and
    ``/v1/embeddings`` that went through a worker step, ``pairs_reranked`` rerank
    pairs, ``steps`` the worker steps (forward passes), ``step_inputs`` how many steps
    carried how many inputs, ``tokens_processed`` the tokens of all steps, and
    ``peak_in_flight`` the most inputs holding a concurrency permit at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._responses: Counter[int] = Counter()
        self._step_inputs: Counter[int] = Counter()
        self._inputs_embedded = 0
        self._pairs_reranked = 0
        self._steps = 0
        self._tokens_processed = 0
        self._peak_in_flight = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self._requests.clear()
            self._responses.clear()
            self._step_inputs.clear()
            self._inputs_embedded = 0
            self._pairs_reranked = 0
            self._steps = 0
            self._tokens_processed = 0
            self._peak_in_flight = 0

    # Recording, called by the service.

    def record_request(self, method: str, path: str) -> None:
        """Count one request."""
        with self._lock:
            self._requests[(method, path)] += 1

    def record_response(self, status: int) -> None:
        """Count one response."""
        with self._lock:
            self._responses[status] += 1

    def record_step(self, *, embedded: int, reranked: int, tokens: int) -> None:
        """Count one worker step that carried ``embedded + reranked`` inputs."""
        with self._lock:
            self._steps += 1
            self._step_inputs[embedded + reranked] += 1
            self._inputs_embedded += embedded
            self._pairs_reranked += reranked
            self._tokens_processed += tokens

    def record_in_flight(self, in_flight: int) -> None:
        """Note how many inputs hold a permit now."""
        with self._lock:
            if in_flight > self._peak_in_flight:
                self._peak_in_flight = in_flight

    # Reading, for tests and benchmarks.

    @property
    def requests(self) -> dict[tuple[str, str], int]:
        """Requests per ``(method, path)``."""
        with self._lock:
            return dict(self._requests)

    @property
    def responses(self) -> dict[int, int]:
        """Responses per status code."""
        with self._lock:
            return dict(self._responses)

    @property
    def inputs_embedded(self) -> int:
        """Embedding inputs computed by worker steps."""
        with self._lock:
            return self._inputs_embedded

    @property
    def pairs_reranked(self) -> int:
        """Rerank (query, text) pairs computed by worker steps."""
        with self._lock:
            return self._pairs_reranked

    @property
    def steps(self) -> int:
        """Worker steps (forward passes) run."""
        with self._lock:
            return self._steps

    @property
    def step_inputs(self) -> dict[int, int]:
        """How many steps carried how many inputs: ``{inputs_in_step: steps}``."""
        with self._lock:
            return dict(self._step_inputs)

    @property
    def max_step_inputs(self) -> int:
        """The most inputs one step carried (0 before the first step)."""
        with self._lock:
            return max(self._step_inputs, default=0)

    @property
    def tokens_processed(self) -> int:
        """Tokens of all steps."""
        with self._lock:
            return self._tokens_processed

    @property
    def peak_in_flight(self) -> int:
        """The most inputs that held a concurrency permit at the same time."""
        with self._lock:
            return self._peak_in_flight

    def snapshot(self) -> dict[str, Any]:
        """All counters at one instant, as plain data."""
        with self._lock:
            return {
                "requests": {f"{m} {p}": n for (m, p), n in self._requests.items()},
                "responses": dict(self._responses),
                "inputs_embedded": self._inputs_embedded,
                "pairs_reranked": self._pairs_reranked,
                "steps": self._steps,
                "step_inputs": dict(self._step_inputs),
                "tokens_processed": self._tokens_processed,
                "peak_in_flight": self._peak_in_flight,
            }
