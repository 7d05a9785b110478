"""How many embedding requests an ingest keeps in flight, learned from the service.

``/info`` says how many inputs a TEI admits at once, not how fast it embeds them.
A GPU answers 16 requests of 32 inputs in well under a second; a CPU-only TEI
with a larger model may need 10 s for one, so the 16th would wait two minutes
in its queue and time out (``QUARRY_EMBED_TIMEOUT``, 60 s) while the service
is working as it should. Every run against such a service failed.

:class:`Pacer` starts with a few requests in flight and goes up to the service's
capacity while answers come back fast (TCP's slow start, in spirit):

- an answer within a quarter of the timeout admits one more request, or, for a
  whole batch answered that fast with others ahead of it, as many as would be
  answered as fast (a GPU's first answers open up to the capacity at once);
- an answer that took over half the timeout admits one fewer;
- a request that timed out behind others halves what is admitted, and is sent
  again (the caller's retry budget is for a service that is down, not for one
  that is slow); one that timed out alone is the service's failure once it does
  so twice (the caller sends it once more: one stall is no verdict).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import CancelledError

__all__ = ["START_IN_FLIGHT", "Pacer"]

START_IN_FLIGHT = 4
"""Requests in flight before the first answers say how fast the service is."""


class Pacer:
    """At most ``limit`` requests in flight, ``limit`` between 1 and ``ceiling``.

    Thread-safe: the callers are an ingest's embedding threads.
    """

    def __init__(self, ceiling: int, timeout: float) -> None:
        """``ceiling``: the service's capacity in requests; ``timeout``: the per-request one."""
        self.ceiling = max(1, ceiling)
        self.limit = min(self.ceiling, START_IN_FLIGHT)
        self.in_flight = 0
        self._fast = timeout / 4
        self._slow = timeout / 2
        self._changed = threading.Condition()
        self._generation = 0  # moved on by cancel_waiting()

    @contextlib.contextmanager
    def slot(self) -> Iterator[int]:
        """Wait for room, then hold it for one request; yields how many requests are in
        flight with this one (those ahead of it in the service's queue, and itself).

        CancelledError, and nothing sent, when :meth:`cancel_waiting` is called while
        this waits."""
        with self._changed:
            generation = self._generation
            while self.in_flight >= self.limit:
                self._changed.wait()
                if self._generation != generation:
                    raise CancelledError("cancelled while waiting to be sent")
            self.in_flight += 1
            depth = self.in_flight
        try:
            yield depth
        finally:
            with self._changed:
                self.in_flight -= 1
                self._changed.notify()

    def cancel_waiting(self) -> None:
        """Every request waiting for room now gives up (its caller is ending: a stopped
        ingest); requests that come later wait as before."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def answered(self, seconds: float, depth: int, *, full: bool = True) -> None:
        """A request sent at ``depth`` was answered after ``seconds`` (retries included).
        Only a ``full`` request (a whole batch) says how long others take: a canary, a
        query or a short last batch is answered faster, and admits one more at most."""
        with self._changed:
            if seconds < self._fast and self.limit < self.ceiling:
                # About seconds / depth a request: this many are answered within _fast.
                room = int(depth * self._fast / max(seconds, 1e-3)) if full else 0
                self.limit = min(self.ceiling, max(self.limit + 1, room))
                self._changed.notify_all()
            elif seconds > self._slow and self.limit > 1:
                self.limit -= 1

    def timed_out(self, depth: int) -> bool:
        """A request sent at ``depth`` timed out. True: fewer are admitted now, and it
        should be sent again; False: it was alone, so the service cannot answer one
        request within the timeout."""
        if depth <= 1:
            return False
        with self._changed:
            self.limit = max(1, min(self.limit, depth // 2))
        return True
