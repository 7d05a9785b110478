"""The router model: permits per input (429), the shared step queue, faults, lifecycle."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx2
import numpy as np
import pytest
from local_tei_support import StartServer, TEISchemas, http_client

from quarry.local_tei import LocalTEIConfig, LocalTEIServer, create_app


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.002)


def test_more_inputs_than_permits_is_429(
    start_server: StartServer, tei_schemas: TEISchemas
) -> None:
    server = start_server(max_concurrent_requests=2)
    with http_client(server.url) as http:
        refused = http.post("/embed", json={"inputs": ["a", "b", "c"]})
        assert refused.status_code == 429
        assert tei_schemas.check_response("/embed", "POST", refused) == {
            "error": "Model is overloaded",
            "error_type": "Overloaded",
        }
        openai = http.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        assert openai.status_code == 429
        assert tei_schemas.check_response("/v1/embeddings", "POST", openai)["code"] == 429
        rerank = http.post("/rerank", json={"query": "q", "texts": ["a", "b", "c"]})
        assert rerank.status_code == 429
        assert http.post("/embed", json={"inputs": ["a", "b"]}).status_code == 200


def test_permits_are_counted_per_input_across_requests(start_server: StartServer) -> None:
    server = start_server(max_concurrent_requests=4, latency_ms=300)
    with http_client(server.url) as http, ThreadPoolExecutor(1) as pool:
        first = pool.submit(http.post, "/embed", json={"inputs": ["a", "b", "c"]})
        _wait_for(lambda: server.stats.peak_in_flight == 3)
        # 3 inputs hold permits: 2 more do not fit, 1 does.
        assert http.post("/embed", json={"inputs": ["d", "e"]}).status_code == 429
        assert http.post("/embed", json={"inputs": ["f"]}).status_code == 200
        assert first.result().status_code == 200
        # Every permit came back.
        assert http.post("/embed", json={"inputs": ["g", "h", "i", "j"]}).status_code == 200
    assert server.stats.responses == {200: 3, 429: 1}


def test_permits_come_back_after_a_refused_request(start_server: StartServer) -> None:
    server = start_server(max_concurrent_requests=2, max_input_length=8)
    with http_client(server.url) as http:
        too_long = " ".join(["w"] * 20)
        for _ in range(3):
            assert http.post("/embed", json={"inputs": ["ok", too_long]}).status_code == 422
        assert http.post("/embed", json={"inputs": ["ok", "fine"]}).status_code == 200


def test_concurrent_requests_share_worker_steps(start_server: StartServer) -> None:
    server = start_server(latency_ms=200)
    requests = 8
    with http_client(server.url) as http, ThreadPoolExecutor(requests) as pool:
        responses = list(
            pool.map(lambda i: http.post("/embed", json={"inputs": f"text {i}"}), range(requests))
        )
    assert all(r.status_code == 200 for r in responses)
    stats = server.stats
    assert stats.inputs_embedded == requests
    assert stats.steps < requests  # inputs of different requests went through one step
    assert stats.max_step_inputs > 1
    assert sum(n * steps for n, steps in stats.step_inputs.items()) == requests


def test_a_step_takes_no_more_than_max_batch_tokens(start_server: StartServer) -> None:
    # 30 words + [CLS] + [SEP] = 32 tokens per input: two fit in a 64-token step.
    server = start_server(latency_ms=100, max_batch_tokens=64, max_input_length=32)
    text = " ".join(["word"] * 30)
    with http_client(server.url) as http, ThreadPoolExecutor(6) as pool:
        statuses = list(
            pool.map(lambda _: http.post("/embed", json={"inputs": text}).status_code, range(6))
        )
        one_request = http.post("/embed", json={"inputs": [text] * 4})
    assert statuses == [200] * 6
    assert one_request.status_code == 200
    assert server.stats.max_step_inputs == 2
    assert server.stats.tokens_processed == 10 * 32


def test_fault_rate_one_answers_only_429_or_503(
    start_server: StartServer, tei_schemas: TEISchemas
) -> None:
    server = start_server(fault_rate=1.0)
    statuses = set()
    with http_client(server.url) as http:
        for i in range(30):
            path, body = [
                ("/embed", {"inputs": "a"}),
                ("/v1/embeddings", {"input": "a"}),
                ("/rerank", {"query": "q", "texts": ["a"]}),
            ][i % 3]
            response = http.post(path, json=body)
            statuses.add(response.status_code)
            assert response.headers["x-local-tei-fault"] == "injected"
            body = tei_schemas.check_response(path, "POST", response)
            kind = body["error_type"]
            assert (response.status_code, kind) in {(429, "Overloaded"), (503, "Unhealthy")}
        assert http.get("/health").status_code == 200
        assert http.get("/info").status_code == 200
    assert statuses == {429, 503}
    assert server.stats.inputs_embedded == 0  # no work was done


def test_fault_rate_zero_injects_nothing(start_server: StartServer) -> None:
    server = start_server(fault_rate=0.0)
    with http_client(server.url) as http:
        assert {http.post("/embed", json={"inputs": "a"}).status_code for _ in range(20)} == {200}


def test_create_app_runs_without_a_server() -> None:
    app = create_app(LocalTEIConfig(backend="hash", dims=16))

    async def scenario() -> list[list[float]]:
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://tei") as http:
                response = await http.post("/embed", json={"inputs": ["a", "b"]})
                assert response.status_code == 200
                vectors: list[list[float]] = response.json()
                return vectors

    vectors = asyncio.run(scenario())
    assert np.array(vectors).shape == (2, 16)
    assert app.state.stats.inputs_embedded == 2


def test_server_binds_the_given_port_and_stop_leaves_nothing_running() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = LocalTEIServer(LocalTEIConfig(backend="hash", port=port))
    with server:
        assert server.url == f"http://127.0.0.1:{port}"
        with http_client(server.url) as http:
            assert http.get("/health").status_code == 200
    server.stop()  # idempotent
    assert not [t for t in threading.enumerate() if t.name.startswith("local-tei")]
    with pytest.raises(httpx2.ConnectError), http_client(server.url) as http:
        http.get("/health")


def test_a_port_in_use_fails_start_and_leaves_nothing_running() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LocalTEIServer(LocalTEIConfig(backend="hash", port=taken.getsockname()[1]))
        with pytest.raises(OSError):
            server.start()
    assert not [t for t in threading.enumerate() if t.name.startswith("local-tei")]


def test_invalid_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        LocalTEIConfig(backend="hash", max_batch_tokens=100)
    with pytest.raises(ValueError, match="fault_rate"):
        LocalTEIConfig(backend="hash", fault_rate=1.5)
    assert LocalTEIConfig().effective_max_input_length == 256
    assert LocalTEIConfig(backend="hash").effective_max_input_length == 512
