"""What the query API costs on top of the work it does: round trip vs. direct calls.

Setup: ``local_tei --backend hash`` with no added latency (a child process), and a
local-mode collection of 20,000 chunks (SciFact abstracts, chunked and embedded by
quarry's own ingest code; kept on tmpfs, ``/dev/shm``, where there is one, since
local mode commits once per point, and reused while it matches).

In the same run, for concurrency 1 and 16, from separate processes:

* **direct**: the embed + search + rerank calls of one query, made with the API's
  own async clients (``AsyncEmbeddingClient``, ``AsyncStore``, ``AsyncRerankClient``)
  in a process of their own, no HTTP server in between; like ``quarry api``, it
  freezes its heap (``gc.freeze``) once the collection is loaded, and runs BLAS on
  one thread;
* **API**: ``POST /v1/query`` round trips against ``quarry api`` (uvicorn, in a child
  process), sent by a load process over keep-alive connections. Like wrk or oha, the
  load process writes HTTP/1.1 itself on asyncio streams (a few dozen lines below),
  so a round trip measures the API and not a Python HTTP client
  (``--client httpx2`` measures with httpx2 instead).

It prints p50/p95/p99 of both, the overhead (API minus direct) and the ratio, the
errors, and the CPU each process (direct, API server, load, TEI) spent per query.
Target: overhead p50 <= 3 ms and p99 <= 15 ms, no errors. Not a test: nothing is
asserted; the figures go to ``bench/.out/query_latency.json``.

    .venv/bin/python bench/query_latency.py [--points 20000] [--requests 400]

The two phases alternate, ``--rounds`` times each (direct, API, direct, API, ...),
and their latencies are pooled per phase: on a shared machine whose speed drifts
by tens of percent within minutes, phases run one after the other would compare
two machines. Local-mode Qdrant admits one process per folder, so the direct
process reads a copy of the collection while the API server holds the original.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_CORPUS, OUT, log, machine, read_corpus, table, write_result
from _tei import TEIProcess, TEISettings

ALIAS = "bench"
API_KEY = "bench-key"
QUERIES = DEFAULT_CORPUS.parent / "queries.jsonl"
CONCURRENCY: tuple[int, ...] = (1, 16)


# -- the collection -------------------------------------------------------------------------


def build_collection(data_dir: Path, tei_url: str, points: int) -> int:
    """A local-mode collection of exactly ``points`` chunks, built by quarry's ingest code.

    Reused when ``data_dir`` already holds one of that size made by the same model.
    """
    from qdrant_client import models

    from quarry._http import NO_WAIT
    from quarry.chunking import Chunker
    from quarry.config import Settings
    from quarry.documents import Document
    from quarry.embeddings import EmbeddingClient
    from quarry.fingerprint import read_fingerprint
    from quarry.ingest import IndexSync, IngestReport
    from quarry.store import VectorStore, open_client

    class FreshStore(VectorStore):
        """For a collection built from nothing: no document has stale chunks to delete.

        Skipping that per-document delete matters in local mode, where each one scans
        every point (thousands of documents x 20k points).
        """

        def delete_stale_chunks(self, doc_id: str, chunk_count: int) -> None:
            return None

    settings = Settings(data_dir=data_dir, collection=ALIAS)
    embedder = EmbeddingClient(tei_url, retry=NO_WAIT)
    store = VectorStore(open_client(settings), ALIAS)
    try:
        if store.exists():
            stored = store.fingerprint()
            live = read_fingerprint(embedder)
            same_model = stored is not None and stored.model_key == live.model_key
            # Collections are made for dot product now; one made for cosine by an
            # earlier build is searched more slowly in local mode, so it is rebuilt.
            vectors = store.client.get_collection(store.resolve() or ALIAS).config.params.vectors
            current = getattr(vectors, "distance", None) == models.Distance.DOT
            if same_model and current and store.count() == points:
                log(f"reusing the collection of {points:,} chunks in {data_dir}")
                return points
        log(f"building a collection of {points:,} chunks in {data_dir} ...")
        store.close()
        import shutil

        shutil.rmtree(settings.qdrant_path, ignore_errors=True)
        store = FreshStore(open_client(settings), ALIAS)
        chunker = Chunker(64, 8)
        sync = IndexSync(store, embedder, chunker)
        sync.prepare(IngestReport(collection=ALIAS))
        chosen: list[Document] = []
        total = 0
        for row in _documents():
            document = Document.create(
                f"scifact/{row['id']}.txt", row["text"], row["title"], {"corpus": "scifact"}
            )
            count = len(chunker.chunk(document))
            if total + count > points:
                continue
            chosen.append(document)
            total += count
            if total == points:
                break
        started = time.perf_counter()
        written = 0
        for start in range(0, len(chosen), 64):
            result = sync.write_batch(chosen[start : start + 64])
            if result.failures:
                raise RuntimeError(f"ingest failed: {result.failures[:3]}")
            written += result.chunks_embedded
        log(
            f"built {written:,} chunks from {len(chosen):,} documents "
            f"in {time.perf_counter() - started:.0f}s"
        )
        return store.count()
    finally:
        store.close()
        embedder.close()


def _documents() -> Any:
    """SciFact abstracts, then (if the corpus runs out) synthetic paragraphs."""
    if DEFAULT_CORPUS.exists():
        yield from read_corpus(DEFAULT_CORPUS, 10**9)
    words = [
        "granite",
        "quarry",
        "water",
        "terrace",
        "cut",
        "stone",
        "deep",
        "metre",
        "basin",
        "crane",
        "rail",
        "lake",
    ]
    for index in range(10**9):
        text = " ".join(words[(index * 7 + i * 3) % len(words)] for i in range(40 + index % 60))
        yield {"id": f"synthetic-{index}", "title": "", "text": text + "."}


def load_queries(count: int = 400) -> list[str]:
    """SciFact's claims as queries (short factual questions), else synthetic ones."""
    if QUERIES.exists():
        lines = QUERIES.read_text(encoding="utf-8").splitlines()
        return [json.loads(line)["text"] for line in lines[:count]]
    return [f"how deep is quarry {i}" for i in range(count)]


# -- closed-loop load ---------------------------------------------------------------------------


Call = Callable[[str], Awaitable[tuple[bool, float | None, float | None]]]
"""One query: (answered, the server's time in the query path, its time in all, if it says)."""


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a process has used so far, from /proc; None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_of(processes: dict[str, int]) -> dict[str, float | None]:
    """:func:`cpu_seconds` of each named process."""
    return {name: cpu_seconds(pid) for name, pid in processes.items()}


async def closed_loop(
    call: Call,
    queries: Sequence[str],
    concurrency: int,
    requests: int,
    processes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``concurrency`` workers, each sending its next query as soon as the last one answers.

    ``processes`` (name -> pid) are the ones whose CPU time the run is charged for
    (this one included): what each spent while it ran goes in ``cpu_s``.
    """
    latencies: list[float] = []
    inside: list[float] = []
    framework: list[float] = []
    errors = 0
    issued = 0

    async def worker() -> None:
        nonlocal issued, errors
        while issued < requests:
            query = queries[issued % len(queries)]
            issued += 1
            started = time.perf_counter()
            try:
                ok, server_ms, app_ms = await call(query)
            except Exception as error:  # counted, never hidden
                log(f"error: {type(error).__name__}: {error}")
                ok, server_ms, app_ms = False, None, None
            elapsed = (time.perf_counter() - started) * 1000
            latencies.append(elapsed)
            if server_ms is not None:
                inside.append(elapsed - server_ms)
                if app_ms is not None:
                    framework.append(app_ms - server_ms)
            errors += 0 if ok else 1

    before = cpu_of(processes or {})
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    after = cpu_of(processes or {})
    spent = {
        name: after[name] - start  # type: ignore[operator]
        for name, start in before.items()
        if start is not None and after[name] is not None
    }
    return {
        "latencies_ms": latencies,
        "outside_ms": inside,
        "framework_ms": framework,
        "errors": errors,
        "seconds": elapsed,
        "cpu_s": spent,
    }


async def run_levels(
    call: Call, queries: Sequence[str], args: argparse.Namespace, **processes: int
) -> dict[str, Any]:
    """A warm-up, then each concurrency level in turn, charging ``processes`` for CPU."""
    await closed_loop(call, queries, 4, args.warmup)
    watched = {name: pid for name, pid in processes.items() if pid}
    out = {}
    for concurrency in CONCURRENCY:
        out[str(concurrency)] = await closed_loop(
            call,
            queries,
            concurrency,
            args.requests * (1 if concurrency == 1 else 4),
            watched,
        )
    return out


def run_loop(main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run a child's load on uvloop, as the API server runs (both sides of the comparison)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# -- child processes ------------------------------------------------------------------------------


def child_direct(args: argparse.Namespace) -> None:
    """The same embed + search + rerank calls as the API makes, with no API in between."""
    from quarry._async_clients import (
        AsyncEmbeddingClient,
        AsyncRerankClient,
        AsyncStore,
        open_async_qdrant,
    )
    from quarry.config import Settings
    from quarry.search import rerank_texts

    async def main() -> dict[str, Any]:
        settings = Settings(data_dir=Path(args.data_dir), collection=ALIAS, embed_url=args.tei)
        store = AsyncStore(open_async_qdrant(settings), ALIAS)
        embedder = AsyncEmbeddingClient(args.tei)
        reranker = AsyncRerankClient(args.tei)
        task = settings.query_task

        async def one(query: str) -> tuple[bool, float | None, float | None]:
            vector = await embedder.embed_query(query, task=task)
            hits = await store.search(vector, 50)
            await reranker.score(query, rerank_texts(hits))
            return bool(hits), None, None

        try:
            # As `quarry api` does once started (create_app(freeze_heap=True)): the
            # collection, loaded by a first query, is kept out of the collector's reach.
            await one("warm up")
            gc.collect()
            gc.freeze()
            return await run_levels(one, load_queries(), args, direct=os.getpid(), tei=args.tei_pid)
        finally:
            await embedder.aclose()
            await reranker.aclose()
            await store.close()

    # BLAS threads as `quarry api` sets them (quarry.api.serve): one, with local mode.
    from quarry.api import _one_blas_thread

    with _one_blas_thread(Settings(data_dir=Path(args.data_dir), collection=ALIAS)):
        Path(args.out).write_text(json.dumps(run_loop(main())))


def child_serve(args: argparse.Namespace) -> None:
    """``quarry api`` on the collection, as ``quarry api --port P`` would run it."""
    from pydantic import SecretStr

    from quarry.api import serve
    from quarry.config import Settings

    serve(
        Settings(
            data_dir=Path(args.data_dir),
            collection=ALIAS,
            embed_url=args.tei,
            api_key=SecretStr(API_KEY),
        ),
        "127.0.0.1",
        args.port,
    )


class _Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads the whole answer."""

    def __init__(self, host: str, port: int, headers: bytes) -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = f"POST {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode()
        self.writer.write(head + self.headers + b"\r\n" + body)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        answer = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.writer.close()
        return status, headers, answer


def child_load(args: argparse.Namespace) -> None:
    """POST /v1/query round trips, over keep-alive connections."""
    # The processes the round trips' CPU is charged to.
    charged = {"load": os.getpid(), "server": args.server_pid, "tei": args.tei_pid}

    def parse(status: int, timing: str, text: str) -> tuple[bool, float | None, float | None]:
        if status != 200:
            log(f"HTTP {status}: {text[:200]}")
            return False, None, None
        # What the server spent inside the query path, to subtract from the round
        # trip of the same request (noise on a busy machine largely cancels), and
        # its whole time on the request (Server-Timing: app;dur=...).
        app_ms = float(timing.split("dur=", 1)[1]) if "dur=" in timing else None
        return True, float(json.loads(text)["timings_ms"]["total"]), app_ms

    async def with_streams() -> dict[str, Any]:
        host, _, port = args.api.removeprefix("http://").rstrip("/").partition(":")
        headers = (
            f"Host: {host}:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\n"
        ).encode()
        idle: list[_Connection] = []

        async def one(query: str) -> tuple[bool, float | None, float | None]:
            connection = idle.pop() if idle else _Connection(host, int(port), headers)
            try:
                body = json.dumps({"query": query}).encode()
                status, answer_headers, answer = await connection.post("/v1/query", body)
            finally:
                idle.append(connection)
            return parse(status, answer_headers.get("server-timing", ""), answer.decode())

        return await run_levels(one, load_queries(), args, **charged)

    async def with_httpx2() -> dict[str, Any]:
        import httpx2

        limits = httpx2.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx2.AsyncClient(
            base_url=args.api,
            headers={"Authorization": f"Bearer {API_KEY}"},
            limits=limits,
            timeout=60,
        ) as client:

            async def one(query: str) -> tuple[bool, float | None, float | None]:
                response = await client.post("/v1/query", json={"query": query})
                timing = response.headers.get("server-timing", "")
                return parse(response.status_code, timing, response.text)

            return await run_levels(one, load_queries(), args, **charged)

    main = with_httpx2 if args.client == "httpx2" else with_streams
    Path(args.out).write_text(json.dumps(run_loop(main())))


def _child(
    command: str, *extra: str, out: Path, args: argparse.Namespace, requests: int
) -> dict[str, Any]:
    subprocess.run(
        [
            sys.executable,
            __file__,
            command,
            "--out",
            str(out),
            "--requests",
            str(requests),
            "--warmup",
            str(args.warmup),
            "--levels",
            args.levels,
            *extra,
        ],
        check=True,
    )
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _default_data_dir() -> Path:
    """On tmpfs when there is one: local-mode Qdrant commits (fsyncs) once per point."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "quarry-bench-query-latency"
    return OUT / "query_latency-data"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the API server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=10) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the API server did not become ready")


# -- the report ---------------------------------------------------------------------------------


def _pool(into: dict[str, Any], run: dict[str, Any]) -> None:
    """Add one round's runs (per concurrency level) to the pooled ones."""
    for level, result in run.items():
        pooled = into.setdefault(
            level,
            {
                "latencies_ms": [],
                "outside_ms": [],
                "framework_ms": [],
                "errors": 0,
                "seconds": 0.0,
                "cpu_s": {},
            },
        )
        for key in ("latencies_ms", "outside_ms", "framework_ms"):
            pooled[key].extend(result.get(key, []))
        pooled["errors"] += result["errors"]
        pooled["seconds"] += result["seconds"]
        for name, seconds in result.get("cpu_s", {}).items():
            pooled["cpu_s"][name] = pooled["cpu_s"].get(name, 0.0) + seconds


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Percentiles, throughput and errors of one closed-loop run."""
    import numpy as np

    values = np.array(run["latencies_ms"])
    summary = {
        "requests": len(values),
        "errors": run["errors"],
        "qps": round(len(values) / run["seconds"], 1),
        "p50": round(float(np.percentile(values, 50)), 2),
        "p95": round(float(np.percentile(values, 95)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
    }
    # CPU each process spent per query, and the share of the machine all of them used.
    cpu = run.get("cpu_s", {})
    if cpu and len(values):
        summary["cpu_ms_per_query"] = {
            name: round(1000 * seconds / len(values), 2) for name, seconds in cpu.items()
        }
        from quarry._async_clients import usable_cpus

        summary["cpu_busy"] = round(sum(cpu.values()) / (run["seconds"] * usable_cpus()), 3)
    for key, name in (("outside_ms", "outside"), ("framework_ms", "framework")):
        if run.get(key):
            spread = np.array(run[key])
            for q in (50, 95, 99):
                summary[f"{name}_p{q}"] = round(float(np.percentile(spread, q)), 2)
    return summary


def orchestrate(args: argparse.Namespace) -> None:
    """Build the collection, run both phases, print the table, write the JSON."""
    info = machine()
    log(f"machine: {info['nproc']} CPUs, {info['cpu']}, load {info['load']}")
    data_dir = Path(args.data_dir) if args.data_dir else _default_data_dir()
    tei_settings = TEISettings(latency_ms=0.0, per_token_us=0.0)
    with TEIProcess(tei_settings) as tei, tempfile.TemporaryDirectory() as scratch:
        points = build_collection(data_dir, tei.url, args.points)
        tmp = Path(scratch)
        direct_dir = data_dir.with_name(data_dir.name + "-direct")
        shutil.rmtree(direct_dir, ignore_errors=True)
        shutil.copytree(data_dir, direct_dir, ignore=shutil.ignore_patterns(".lock"))
        per_round = max(1, args.requests // args.rounds)
        port = _free_port()
        api_url = f"http://127.0.0.1:{port}"
        log(f"API server at {api_url} ...")
        OUT.mkdir(parents=True, exist_ok=True)
        server_log = (OUT / "query_latency-server.log").open("wb")
        server = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "_serve",
                "--data-dir",
                str(data_dir),
                "--tei",
                tei.url,
                "--port",
                str(port),
            ],
            stdout=server_log,
            stderr=subprocess.STDOUT,
        )
        direct: dict[str, Any] = {}
        api: dict[str, Any] = {}
        try:
            _wait_ready(api_url, server)
            for round_ in range(1, args.rounds + 1):
                log(f"round {round_}/{args.rounds}: direct calls (no API) ...")
                _pool(
                    direct,
                    _child(
                        "_direct",
                        "--data-dir",
                        str(direct_dir),
                        "--tei",
                        tei.url,
                        "--tei-pid",
                        str(tei.pid),
                        out=tmp / "d.json",
                        args=args,
                        requests=per_round,
                    ),
                )
                log(f"round {round_}/{args.rounds}: API round trips ...")
                _pool(
                    api,
                    _child(
                        "_load",
                        "--api",
                        api_url,
                        "--client",
                        args.client,
                        "--tei-pid",
                        str(tei.pid),
                        "--server-pid",
                        str(server.pid),
                        out=tmp / "a.json",
                        args=args,
                        requests=per_round,
                    ),
                )
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            server_log.close()
            shutil.rmtree(direct_dir, ignore_errors=True)

    rows = []
    results: dict[str, Any] = {}
    for level in map(str, CONCURRENCY):
        d, a = summarize(direct[level]), summarize(api[level])
        results[level] = {"direct": d, "api": a}
        rows.append(
            [
                int(level),
                d["p50"],
                d["p95"],
                d["p99"],
                a["p50"],
                a["p95"],
                a["p99"],
                round(a["p50"] - d["p50"], 2),
                round(a["p99"] - d["p99"], 2),
                f"{a['p50'] / d['p50']:.2f}x",
                f"{a['p99'] / d['p99']:.2f}x",
                a.get("outside_p50"),
                a.get("outside_p99"),
                a.get("framework_p50"),
                a.get("framework_p99"),
                a["qps"],
                d["errors"] + a["errors"],
            ]
        )
    print(
        f"\nquery latency, ms: {points:,} chunks (local-mode Qdrant), local_tei hash "
        f"{tei_settings.dims}d no added latency, candidates 50 + rerank, top_k 10; "
        f"{args.requests} requests at c=1, 4x that at higher concurrency, in {args.rounds} "
        f"alternating rounds per phase; load client "
        f"{'httpx2' if args.client == 'httpx2' else 'HTTP/1.1 on asyncio streams'}; "
        f"{info['nproc']} CPUs, load {info['load']}\n"
    )
    print(
        table(
            [
                "conc",
                "direct p50",
                "p95",
                "p99",
                "API p50",
                "p95",
                "p99",
                "overhead p50",
                "overhead p99",
                "ratio p50",
                "ratio p99",
                "paired p50",
                "paired p99",
                "server p50",
                "server p99",
                "API qps",
                "errors",
            ],
            rows,
        )
    )
    print(
        "\noverhead = API round trip - direct calls at the same percentile; "
        "paired = round trip - the server's own timings_ms.total, per request (HTTP, "
        "framework, auth, validation, serialization, logging: the noise of a busy machine "
        "mostly cancels); server = the part of paired spent inside the API server (its "
        "Server-Timing app duration - timings_ms.total), the rest is the client's HTTP stack "
        "and the loopback. overhead compares two phases: in the API phase the load process, "
        "the server and TEI share the CPUs, so the query work inside the server is slower "
        "too; paired takes that out. target: overhead p50 <= 3 ms, p99 <= 15 ms, no errors."
    )
    cpu_rows = _cpu_rows(results)
    if cpu_rows:
        print(
            "\nCPU per query, ms, by process (from /proc, over the measured requests only); "
            "busy = all of them together as a share of the machine's CPUs\n"
        )
        print(
            table(
                ["conc", "phase", "direct", "API server", "load", "TEI", "total", "busy"],
                cpu_rows,
            )
        )
    print()
    for level, row in zip(map(str, CONCURRENCY), rows, strict=True):
        d, a = results[level]["direct"], results[level]["api"]
        verdicts = [
            f"overhead p50 {row[7]} ms {'met' if row[7] <= 3 else 'MISSED'}",
            f"p99 {row[8]} ms {'met' if row[8] <= 15 else 'MISSED'}",
            f"errors {row[-1]} {'met' if row[-1] == 0 else 'MISSED'}",
        ]
        print(f"target at c={level}: " + "; ".join(verdicts))
        if int(level) > 1 and d["qps"] and a["qps"]:
            # Closed loop: latency = concurrency / throughput, so whatever an API request
            # holds the slowest stage (the CPUs, or local mode's one search thread) longer
            # than the direct calls do is paid once per request ahead of it in line.
            extra_ms = 1000 / a["qps"] - 1000 / d["qps"]
            print(
                f"  at c={level}: {d['qps']} direct vs {a['qps']} API queries/s, so each API "
                f"request holds the line {extra_ms:.2f} ms longer, and a request waits behind "
                f"{int(level) - 1} others: {int(level)} x {extra_ms:.2f} = "
                f"{int(level) * extra_ms:.1f} ms of p50 overhead"
            )
            d_cpu, a_cpu = d.get("cpu_ms_per_query"), a.get("cpu_ms_per_query")
            if d_cpu and a_cpu:
                print(
                    f"  CPU per query: {sum(a_cpu.values()):.2f} ms through the API (the load "
                    f"process's {a_cpu.get('load', 0):.2f} ms included) vs "
                    f"{sum(d_cpu.values()):.2f} ms direct "
                    f"({sum(a_cpu.values()) - sum(d_cpu.values()):+.2f} ms); "
                    f"the machine was {a['cpu_busy']:.0%} busy in the API phase, "
                    f"{d['cpu_busy']:.0%} in the direct one"
                )
    path = write_result(
        "query_latency",
        {
            "machine": info,
            "load_after": os.getloadavg(),
            "points": points,
            "tei": tei_settings.to_dict(),
            "requests": args.requests,
            "rounds": args.rounds,
            "client": args.client,
            "results": results,
        },
    )
    log(f"wrote {path}")


def _cpu_rows(results: dict[str, Any]) -> list[list[Any]]:
    """Rows of the CPU table: per level and phase, each process's CPU ms per query."""
    rows = []
    for level, phases in results.items():
        for phase in ("direct", "api"):
            cpu = phases[phase].get("cpu_ms_per_query")
            if not cpu:
                continue
            rows.append(
                [
                    int(level),
                    "direct" if phase == "direct" else "API",
                    cpu.get("direct", "-"),
                    cpu.get("server", "-"),
                    cpu.get("load", "-"),
                    cpu.get("tei", "-"),
                    round(sum(cpu.values()), 2),
                    f"{phases[phase]['cpu_busy']:.0%}",
                ]
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``query_latency.py`` (orchestrator) or one of its children (``_direct`` etc.)."""
    parser = argparse.ArgumentParser(prog="bench/query_latency.py", description=__doc__)
    parser.add_argument(
        "role", nargs="?", default="run", choices=["run", "_direct", "_serve", "_load"]
    )
    parser.add_argument("--points", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=400, help="at c=1; 4x that at c=16")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--rounds", type=int, default=4, help="alternating rounds of each phase (default 4)"
    )
    parser.add_argument(
        "--levels", default="1,16", help="concurrency levels, comma-separated (default 1,16)"
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--tei")
    parser.add_argument("--api")
    parser.add_argument(
        "--client",
        choices=["streams", "httpx2"],
        default="streams",
        help="the load process's HTTP client (default: HTTP/1.1 on asyncio streams)",
    )
    parser.add_argument("--tei-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    global CONCURRENCY
    CONCURRENCY = tuple(int(level) for level in args.levels.split(","))
    {"run": orchestrate, "_direct": child_direct, "_serve": child_serve, "_load": child_load}[
        args.role
    ](args)


if __name__ == "__main__":
    main()
