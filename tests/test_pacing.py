"""Pacing of embedding requests (quarry._pacing): what a slow service is sent."""

from __future__ import annotations

import threading

import pytest

from quarry._http import RetryPolicy
from quarry._pacing import START_IN_FLIGHT, Pacer
from quarry.embeddings import EmbeddedPart, EmbeddingClient
from quarry.errors import ServiceUnavailable
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
