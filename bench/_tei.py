"""The stand-in GPU server, in its own process, and the client that measures its capacity.

``python bench/_tei.py [flags]`` serves ``quarry.local_tei``'s hash backend exactly as
``python -m quarry.local_tei --backend hash`` does, plus one read-only route,
``GET /bench/stats``, with the server's counters (requests per route, responses per
status, inputs embedded, worker steps), so that a benchmark can count what any
client, quarry's or a peer's, asked of the server. It prints its URL on stdout.

``TEIProcess`` starts it from a benchmark; :func:`measure_capacity` is the
saturating raw client (requests of ``max_client_batch_size`` inputs, enough of them
in flight to keep the queue full, bodies encoded before the clock starts).

Imports of quarry, uvicorn and httpx2 are local: the peers' environment imports
this module for :func:`server_stats` only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TEISettings:
    """How the stand-in GPU server is configured (the flags of ``python -m quarry.local_tei``).

    The defaults model one mid-size embedding model on one GPU: a forward pass over a
    full batch of 16,384 tokens costs 30 ms + 16,384 x 2 us = 63 ms.
    """

    dims: int = 384
    latency_ms: float = 30.0
    per_token_us: float = 2.0
    max_batch_tokens: int = 16384
    max_client_batch_size: int = 32
    max_concurrent_requests: int = 512
    max_input_length: int = 512

    def flags(self) -> list[str]:
        """Command-line flags for ``python -m quarry.local_tei`` (and ``bench/_tei.py``)."""
        return [
            "--backend",
            "hash",
            "--dims",
            str(self.dims),
            "--latency-ms",
            str(self.latency_ms),
            "--per-token-us",
            str(self.per_token_us),
            "--max-batch-tokens",
            str(self.max_batch_tokens),
            "--max-client-batch-size",
            str(self.max_client_batch_size),
            "--max-concurrent-requests",
            str(self.max_concurrent_requests),
            "--max-input-length",
            str(self.max_input_length),
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the JSON result."""
        return {"backend": "hash", **asdict(self)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags, for a benchmark's own command line."""
    d = TEISettings()
    group = parser.add_argument_group("stand-in GPU server (local_tei --backend hash)")
    group.add_argument("--dims", type=int, default=d.dims)
    group.add_argument("--latency-ms", type=float, default=d.latency_ms)
    group.add_argument("--per-token-us", type=float, default=d.per_token_us)
    group.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens)
    group.add_argument("--max-client-batch-size", type=int, default=d.max_client_batch_size)
    group.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests)
    group.add_argument("--max-input-length", type=int, default=d.max_input_length)


def settings_from(args: argparse.Namespace) -> TEISettings:
    """TEISettings from parsed arguments (see :func:`add_arguments`)."""
    return TEISettings(
        dims=args.dims,
        latency_ms=args.latency_ms,
        per_token_us=args.per_token_us,
        max_batch_tokens=args.max_batch_tokens,
        max_client_batch_size=args.max_client_batch_size,
        max_concurrent_requests=args.max_concurrent_requests,
        max_input_length=args.max_input_length,
    )


# -- the server process -----------------------------------------------------------------


def _serve(argv: Sequence[str]) -> None:
    """Run local_tei (hash backend) with ``/bench/stats``; print the URL, serve until killed."""
    import uvicorn
    from fastapi.responses import JSONResponse

    from quarry.local_tei import LocalTEIConfig, ServerStats, create_app

    parser = argparse.ArgumentParser(prog="bench/_tei.py")
    parser.add_argument("--backend", choices=["hash"], default="hash")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    add_arguments(parser)
    args = parser.parse_args(argv)
    s = settings_from(args)
    config = LocalTEIConfig(
        backend="hash",
        host=args.host,
        port=args.port,
        dims=s.dims,
        max_input_length=s.max_input_length,
        max_client_batch_size=s.max_client_batch_size,
        max_batch_tokens=s.max_batch_tokens,
        max_concurrent_requests=s.max_concurrent_requests,
        latency_ms=s.latency_ms,
        per_token_us=s.per_token_us,
    )
    stats = ServerStats()
    app = create_app(config, stats=stats)

    async def bench_stats() -> JSONResponse:
        return JSONResponse(stats.snapshot())

    app.add_api_route("/bench/stats", bench_stats, methods=["GET"])
    # IPPROTO_TCP explicitly, as local_tei does: asyncio then sets TCP_NODELAY.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_keep_alive=75,
            backlog=4096,
        )
    )
    print(url, flush=True)
    server.run(sockets=[sock])


class TEIProcess:
    """``bench/_tei.py`` in a child process: ``with TEIProcess(settings) as tei: tei.url``."""

    def __init__(self, settings: TEISettings) -> None:
        self.settings = settings
        self.url = ""
        self.pid = 0
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> TEIProcess:
        self._process = subprocess.Popen(
            [sys.executable, __file__, *self.settings.flags()],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self._process.pid
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.startswith("http://"):
            self.__exit__()
            raise RuntimeError(f"bench/_tei.py did not start (said {line!r})")
        self.url = line
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/info", timeout=5) as response:
                    json.loads(response.read())
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise
                time.sleep(0.1)
        return self

    def stats(self) -> dict[str, Any]:
        """The server's counters now."""
        return server_stats(self.url)

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def server_stats(url: str) -> dict[str, Any]:
    """``GET /bench/stats`` (standard library only: the peers' environment calls it too)."""
    with urllib.request.urlopen(f"{url}/bench/stats", timeout=30) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots: embedding requests, inputs, steps, responses."""

    def embed_requests(snapshot: dict[str, Any]) -> int:
        routes = ("POST /v1/embeddings", "POST /embeddings", "POST /embed", "POST /")
        return sum(int(snapshot["requests"].get(route, 0)) for route in routes)

    responses: dict[str, int] = {}
    for status, count in after["responses"].items():
        diff = int(count) - int(before["responses"].get(status, 0))
        if str(status) == "200":
            diff -= 1  # the answer to the ``before`` snapshot's own request
        if diff:
            responses[str(status)] = diff
    steps = after["steps"] - before["steps"]
    inputs = after["inputs_embedded"] - before["inputs_embedded"]
    return {
        "embed_requests": embed_requests(after) - embed_requests(before),
        "inputs_embedded": inputs,
        "tokens": after["tokens_processed"] - before["tokens_processed"],
        "steps": steps,
        "inputs_per_step": round(inputs / steps, 1) if steps else None,
        "responses": responses,
    }


# -- the saturating raw client ----------------------------------------------------------


def measure_capacity(
    url: str,
    texts: Sequence[str],
    *,
    batch: int,
    in_flight_inputs: int,
    min_seconds: float = 4.0,
) -> dict[str, Any]:
    """Inputs/s the server sustains when it never waits for a client.

    Requests of ``batch`` inputs, ``in_flight_inputs // batch`` of them in flight at
    all times, over ``texts`` repeated until the run lasts at least ``min_seconds``.
    Bodies are encoded before the clock starts and answers are not decoded, so the
    client costs the server as little CPU as a client can.
    """
    return asyncio.run(_capacity(url, texts, batch, in_flight_inputs, min_seconds))


async def _capacity(
    url: str, texts: Sequence[str], batch: int, in_flight_inputs: int, min_seconds: float
) -> dict[str, Any]:
    import httpx2

    bodies = [
        json.dumps(
            {"input": list(texts[i : i + batch]), "model": "bench", "encoding_format": "base64"}
        ).encode()
        for i in range(0, len(texts), batch)
    ]
    sizes = [min(batch, len(texts) - i) for i in range(0, len(texts), batch)]
    workers = max(1, in_flight_inputs // batch)
    limits = httpx2.Limits(max_connections=workers, max_keepalive_connections=workers)
    headers = {"content-type": "application/json"}
    async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        # One pass to warm the connections and the server's token cache.
        await _drive(client, bodies, sizes, workers, headers)
        before = server_stats(url)
        rounds = 0
        done = 0
        rejected = 0
        started = time.perf_counter()
        while True:
            n, r = await _drive(client, bodies, sizes, workers, headers)
            done += n
            rejected += r
            rounds += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                break
        after = server_stats(url)
    return {
        "inputs": done,
        "seconds": round(elapsed, 3),
        "inputs_per_s": round(done / elapsed, 1),
        "rounds": rounds,
        "batch": batch,
        "requests_in_flight": workers,
        "retried_429": rejected,
        "server": stats_delta(before, after),
    }


async def _drive(
    client: Any, bodies: list[bytes], sizes: list[int], workers: int, headers: dict[str, str]
) -> tuple[int, int]:
    queue = list(range(len(bodies)))
    queue.reverse()
    done = 0
    rejected = 0

    async def worker() -> None:
        nonlocal done, rejected
        while queue:
            i = queue.pop()
            while True:
                response = await client.post("/v1/embeddings", content=bodies[i], headers=headers)
                if response.status_code == 429:
                    rejected += 1
                    await asyncio.sleep(0.005)
                    continue
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                done += sizes[i]
                break

    await asyncio.gather(*(worker() for _ in range(workers)))
    return done, rejected


def model_floor_seconds(settings: TEISettings, token_counts: Sequence[int]) -> float:
    """The step-cost model's own lower bound for embedding inputs of these token counts.

    Inputs packed into full steps of ``max_batch_tokens`` tokens, each step costing
    ``latency_ms + per_token_us * tokens``; the server's own CPU and HTTP are free.
    """
    steps = 0
    tokens = 0
    for count in token_counts:
        if tokens and tokens + count > settings.max_batch_tokens:
            steps += 1
            tokens = 0
        tokens += count
    steps += 1 if tokens else 0
    return steps * settings.latency_ms / 1e3 + sum(token_counts) * settings.per_token_us / 1e6


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _serve(sys.argv[1:])
