"""Pacing of embedding requests (quarry._pacing): what a slow service is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import httpx2
import pytest

from quarry._http import RetryPolicy
from quarry._pacing import START_IN_FLIGHT, Pacer
from quarry.embeddings import EmbeddedPart, EmbeddingClient
from quarry.errors import ServiceUnavailable
from quarry.fingerprint import read_fingerprint
from quarry.local_tei import LocalTEIConfig, LocalTEIServer


def test_a_pacer_starts_low_and_grows_to_the_ceiling_while_answers_are_fast() -> None:
    pacer = Pacer(ceiling=16, timeout=60.0)
    assert pacer.limit == START_IN_FLIGHT < 16
    pacer.answered(10.0, depth=1)  # within a quarter of the timeout: one more
    assert pacer.limit == START_IN_FLIGHT + 1
    pacer.answered(0.5, depth=2)  # 0.25 s a request: 16 are answered within 15 s
    assert pacer.limit == 16
    assert Pacer(ceiling=2, timeout=60.0).limit == 2


def test_slow_answers_and_timeouts_admit_fewer() -> None:
    pacer = Pacer(ceiling=16, timeout=60.0)
    pacer.answered(0.5, depth=4)
    pacer.answered(40.0, depth=16)  # over half the timeout
    assert pacer.limit == 15
    pacer.answered(20.0, depth=8)  # neither fast nor slow: as it was
    assert pacer.limit == 15
    assert pacer.timed_out(depth=12) is True
    assert pacer.limit == 6
    assert pacer.timed_out(depth=2) is True
    assert pacer.limit == 1
    # Alone in flight and still no answer: the service's failure, nothing to lower.
    assert pacer.timed_out(depth=1) is False


def test_a_slot_waits_for_room_under_the_limit() -> None:
    pacer = Pacer(ceiling=1, timeout=60.0)
    entered = threading.Event()
    with pacer.slot() as depth:
        assert depth == 1
        waiter = threading.Thread(target=lambda: pacer.slot().__enter__() and entered.set())
        waiter.start()
        assert not entered.wait(0.2)  # the only slot is held
    waiter.join(5)
    assert entered.is_set()


def test_cancel_waiting_sends_none_of_the_requests_waiting_for_room() -> None:
    pacer = Pacer(ceiling=1, timeout=60.0)
    outcome: list[BaseException | int] = []

    def wait_for_room() -> None:
        try:
            with pacer.slot() as depth:
                outcome.append(depth)
        except CancelledError as error:
            outcome.append(error)

    with pacer.slot():
        waiter = threading.Thread(target=wait_for_room)
        waiter.start()
        time.sleep(0.1)
        pacer.cancel_waiting()
        waiter.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], CancelledError)
    with pacer.slot() as depth:  # later requests wait and go as before
        assert depth == 1


def test_a_stopped_ingest_sends_nothing_more_and_waits_for_no_answer() -> None:
    # The pool starts a thread per request; all but the pacer's first few wait for
    # room. A stop (cancel_pending) must not let them go out one wave after another,
    # nor keep the caller until the requests in flight are answered.
    config = LocalTEIConfig(backend="hash", dims=8, latency_ms=3000.0)
    with LocalTEIServer(config) as service:
        with EmbeddingClient(service.url, batch_size=1, concurrency=16) as client:
            _ = client.info
            answered = service.stats.responses.get(200, 0)  # /info
            outcome: list[object] = []
            caller = threading.Thread(
                target=lambda: outcome.append(
                    _raised(lambda: client.embed_passages([f"text {n}" for n in range(32)]))
                )
            )
            caller.start()
            time.sleep(0.3)  # the first wave is in flight
            client.cancel_pending()
            caller.join(10)
            # The caller is back and none of the requests in flight has been answered.
            assert service.stats.responses.get(200, 0) == answered
            sent = sum(n for (method, _), n in service.stats.requests.items() if method == "POST")
    assert isinstance(outcome[0], CancelledError)
    assert sent == START_IN_FLIGHT, sent  # the first wave only, not all 32


def _raised(call: Callable[[], object]) -> object:
    try:
        return call()
    except BaseException as error:
        return error


def _slow_service(step_ms: float) -> LocalTEIServer:
    """A healthy service that embeds one input per step, ``step_ms`` a step: a CPU-only
    TEI in miniature. Its /info admits 512 inputs at once, as TEI's default does."""
    config = LocalTEIConfig(
        backend="hash", dims=8, latency_ms=step_ms, max_batch_tokens=32, max_input_length=32
    )
    return LocalTEIServer(config)


def _passage(n: int) -> str:
    """Over half of the service's 32-token step: one passage a step."""
    return f"passage number {n} " + "word " * 18


def test_a_slow_service_is_not_sent_more_than_it_answers_in_time() -> None:
    texts = [_passage(n) for n in range(16)]
    with _slow_service(step_ms=250) as service:
        # 16 requests at once would wait up to 4 s in its queue: past the 1.2 s timeout.
        # No retry budget: a timeout is not the service being down.
        with EmbeddingClient(
            service.url, batch_size=1, concurrency=16, timeout=1.2, retry=RetryPolicy(budget=0)
        ) as client:
            results = client.embed_passages(texts)
    assert len(results) == len(texts)
    assert all(isinstance(r, list) and isinstance(r[0], EmbeddedPart) for r in results)


def test_a_request_that_times_out_alone_names_the_timeout_setting() -> None:
    with _slow_service(step_ms=1500) as service:
        with EmbeddingClient(
            service.url, batch_size=1, timeout=0.5, retry=RetryPolicy(budget=0)
        ) as client:
            with pytest.raises(ServiceUnavailable) as caught:
                client.embed_passages([_passage(1)], documents=["notes/a.md"])
    message = str(caught.value)
    assert "QUARRY_EMBED_TIMEOUT" in message and "notes/a.md" in message
    assert "twice" in message  # a lone timeout is tried once more before this verdict


class _FirstEmbedFails(httpx2.HTTPTransport):
    """A real local_tei behind a network where the first embedding request fails with
    ``error`` after ``after_s`` seconds: a read timeout (a stall, once), or a connect
    timeout (a dropped SYN: nothing reached the service, nothing is queued there)."""

    def __init__(
        self, error: type[httpx2.TimeoutException] = httpx2.ReadTimeout, after_s: float = 0.0
    ) -> None:
        super().__init__()
        self.error, self.after_s = error, after_s
        self.failed = self.sent = 0

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path.endswith("embeddings"):
            self.sent += 1
            if not self.failed:
                self.failed += 1
                time.sleep(self.after_s)
                raise self.error("timed out", request=request)
        return super().handle_request(request)


def test_one_stall_of_a_lone_request_is_sent_again_not_the_runs_end() -> None:
    # Fault trial: one request that hung once, with no other in flight, failed the
    # nightly run ("the service cannot embed one batch in that time"); resent, the same
    # batch embedded in milliseconds.
    network = _FirstEmbedFails()
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=8)) as service:
        with EmbeddingClient(
            service.url,
            transport=network,
            concurrency=1,
            timeout=5,
            retry=RetryPolicy(budget=0),
            dialect="openai",
        ) as client:
            [result] = client.embed_passages([_passage(1)], documents=["notes/a.md"])
    assert network.failed == 1
    assert isinstance(result, list) and isinstance(result[0], EmbeddedPart)


def test_a_stall_during_a_stop_is_not_sent_again() -> None:
    # Review: cancel_pending() (a stopping ingest) did not stop the lone retry, so a
    # stopping run sent one more request, which may take QUARRY_EMBED_TIMEOUT.
    network = _FirstEmbedFails(after_s=1.0)
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=8)) as service:
        with EmbeddingClient(
            service.url,
            transport=network,
            concurrency=1,
            timeout=5,
            retry=RetryPolicy(budget=0),
            dialect="openai",
        ) as client:
            _ = client.info
            threading.Timer(0.3, client.cancel_pending).start()
            with pytest.raises(CancelledError):
                client.embed_passages([_passage(1)], documents=["notes/a.md"])
    assert network.sent == 1


def _slow_per_token_service() -> LocalTEIServer:
    # 1 ms a token, one request of 16 passages (41 tokens each) a step: a CPU-only TEI
    # in miniature, where a request takes ~0.66 s and the 25-token canary ~0.03 s.
    config = LocalTEIConfig(
        backend="hash", dims=8, per_token_us=1000, max_batch_tokens=768, max_input_length=48
    )
    return LocalTEIServer(config)


def _long_passage(n: int) -> str:
    return f"passage number {n} " + "word " * 36


def _run(canary_first: bool) -> tuple[int, int]:
    texts = [_long_passage(n) for n in range(12 * 16)]  # 12 requests of 16
    with _slow_per_token_service() as service:
        # 12 requests at once wait up to 7.9 s in its queue: past the 6 s timeout.
        # Started at 4 in flight (2.6 s at most), none times out.
        with EmbeddingClient(
            service.url, batch_size=16, concurrency=12, timeout=6.0, retry=RetryPolicy(budget=0)
        ) as client:
            if canary_first:
                read_fingerprint(client)  # as IndexSync.prepare / verify_canary do
            start = client.requests_sent
            results = client.embed_passages(texts)
            sent = client.requests_sent - start
    assert len(results) == len(texts)
    return sent, len(texts) // 16


def test_without_a_canary_a_slow_service_gets_no_request_twice() -> None:
    sent, batches = _run(canary_first=False)
    assert sent == batches


def test_the_canary_does_not_open_the_pacer_to_the_services_capacity() -> None:
    # Every ingest that embeds reads the canary first, on the same client: a one-input
    # request answered in one step must not stand for 16-input ones.
    sent, batches = _run(canary_first=True)
    assert sent == batches, f"{sent - batches} requests timed out and were sent again"


def test_a_connect_timeout_is_retried_within_the_budget_as_before() -> None:
    # Not an answer that came late: the service never saw the request, so it says
    # nothing about how fast the service embeds, and a retry is what the budget is for.
    transport = _FirstEmbedFails(httpx2.ConnectTimeout)
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=8)) as service:
        with EmbeddingClient(
            service.url,
            transport=transport,
            timeout=5.0,
            retry=RetryPolicy(budget=30, initial=0.01, maximum=0.01, jitter=0),
        ) as client:
            vector = client.embed_query("what is a quarry?")
    assert transport.failed == 1 and len(vector) == 8
