"""How close each client comes to the embedding server's capacity (issue #7).

The server: ``quarry.local_tei --backend hash`` in its own process stands in for a GPU
running TEI. It works as TEI does: one queue, one worker loop that takes up to
``--max-batch-tokens`` tokens of queued inputs per step (whichever requests they came
from), each step costing ``--latency-ms`` plus ``--per-token-us`` per token, and a
429 when more than ``--max-concurrent-requests`` inputs are waiting. Defaults: 30 ms +
2 us/token, 16,384 tokens per step, 32 inputs per request, 512 inputs in flight.

The inputs: SciFact abstracts (real text nobody here wrote) cut by quarry's chunker
(256 tokens, 32 overlap), the passages an ingest embeds.

In one run, round after round (default 3; the slow peers in the first round only):

* **capacity**: inputs/s of a saturating raw client (requests of
  ``max_client_batch_size`` inputs, ``max_concurrent_requests`` inputs in flight,
  bodies encoded before the clock starts, answers not decoded);
* **quarry**: ``EmbeddingClient.embed_passages`` with its defaults (limits from ``/info``);
* **LlamaIndex** ``TextEmbeddingsInference`` (llama-index-embeddings-text-embeddings-
  inference): defaults (``embed_batch_size=10``, sync); best documented settings
  (``embed_batch_size=32``) sync, and async with ``num_workers=16``;
* **LangChain** ``OpenAIEmbeddings(check_embedding_ctx_length=False)``: defaults
  (``chunk_size=1000``); best documented settings (``chunk_size=32``).

Peers run in their own virtualenv (``bench/.peers``, ``bench/requirements-peers.txt``),
as child processes; only the embedding call is timed (after a one-input warm-up), and
the server's own counters say what each client sent. A client's share of capacity is
taken per round (against that round's capacity) and the median is reported.

Targets: quarry >= 90% of capacity, >= 2x the best-tuned peer, >= 5x the peers'
defaults. Not a test: nothing is asserted; the figures go to
``bench/.out/embed_saturation.json``.

    .venv/bin/python bench/embed_saturation.py [--docs 1200] [--rounds 3] [--no-peers]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import _tei
from _common import DEFAULT_CORPUS, load, log, machine, read_corpus, table, write_result

NAME = "embed_saturation"

# name -> (family, kind, description)
PEERS: dict[str, tuple[str, str, str]] = {
    "llamaindex-defaults": (
        "LlamaIndex",
        "defaults",
        "TextEmbeddingsInference(model_name, base_url): embed_batch_size=10, "
        "get_text_embedding_batch (sync, one request at a time)",
    ),
    "llamaindex-best-sync": (
        "LlamaIndex",
        "best",
        "TextEmbeddingsInference(..., embed_batch_size=32): get_text_embedding_batch",
    ),
    "llamaindex-best-async": (
        "LlamaIndex",
        "best",
        "TextEmbeddingsInference(..., embed_batch_size=32, num_workers=16): "
        "aget_text_embedding_batch (16 requests in flight)",
    ),
    "langchain-defaults": (
        "LangChain",
        "defaults",
        "OpenAIEmbeddings(model, base_url, check_embedding_ctx_length=False): "
        "chunk_size=1000, embed_documents",
    ),
    "langchain-best": (
        "LangChain",
        "best",
        "OpenAIEmbeddings(..., check_embedding_ctx_length=False, chunk_size=32): embed_documents",
    ),
}
PEER_PACKAGES = [
    "llama-index-core",
    "llama-index-embeddings-text-embeddings-inference",
    "langchain-core",
    "langchain-openai",
    "openai",
]


# -- inputs ---------------------------------------------------------------------------------


def passages(corpus: Path, docs: int) -> list[str]:
    """The chunks quarry's chunker (256 tokens, 32 overlap) makes of the first ``docs`` documents."""
    from quarry.chunking import Chunker
    from quarry.documents import Document

    chunker = Chunker(256, 32)
    texts: list[str] = []
    for doc in read_corpus(corpus, docs):
        body = f"{doc['title']}\n\n{doc['text']}" if doc["title"] else doc["text"]
        texts.extend(chunk.text for chunk in chunker.chunk(Document.create(doc["id"], body)))
    return texts


# -- the clients ----------------------------------------------------------------------------


def run_quarry(url: str, texts: list[str]) -> dict[str, Any]:
    """quarry's EmbeddingClient with its defaults, timed over one ``embed_passages`` call."""
    from quarry.embeddings import EmbeddingClient, EmbedFailure

    with EmbeddingClient(url) as client:
        client.embed_passages(texts[:1])  # reads /info, opens a connection
        started = time.perf_counter()
        results = client.embed_passages(texts)
        seconds = time.perf_counter() - started
        failures = sum(1 for r in results if isinstance(r, EmbedFailure))
        settings = {"batch_size": client.batch_size, "concurrency": client.concurrency}
    ok = len(results) == len(texts) and failures == 0
    return {
        "ok": ok,
        "error": None if ok else f"{failures} inputs failed",
        "inputs": len(texts),
        "seconds": seconds,
        "settings": settings,
    }


def peer_child(name: str, url: str, model: str, texts_file: Path, dims: int) -> dict[str, Any]:
    """Runs in bench/.peers: one peer configuration, timed over one batch-embedding call."""
    texts: list[str] = json.loads(texts_file.read_text())
    embed = _peer_embedder(name, url, model)
    try:
        embed(texts[:1])
        started = time.perf_counter()
        vectors = embed(texts)
        seconds = time.perf_counter() - started
    except Exception as error:  # a peer's failure is a result, not a crash
        message = f"{type(error).__name__}: {error}"
        return {"ok": False, "error": message[:400], "inputs": len(texts)}
    good = (
        isinstance(vectors, list)
        and len(vectors) == len(texts)
        and all(isinstance(v, list) and len(v) == dims for v in vectors)
    )
    return {
        "ok": good,
        "error": None if good else "answers were not one vector per input",
        "inputs": len(texts),
        "seconds": seconds,
    }


def _peer_embedder(name: str, url: str, model: str) -> Any:
    if name.startswith("llamaindex"):
        from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

        if name == "llamaindex-defaults":
            li = TextEmbeddingsInference(model_name=model, base_url=url)
            return li.get_text_embedding_batch
        if name == "llamaindex-best-sync":
            li = TextEmbeddingsInference(model_name=model, base_url=url, embed_batch_size=32)
            return li.get_text_embedding_batch
        import asyncio

        li = TextEmbeddingsInference(model_name=model, base_url=url, embed_batch_size=32)
        li.num_workers = 16
        return lambda texts: asyncio.run(li.aget_text_embedding_batch(texts))
    from langchain_openai import OpenAIEmbeddings

    extra: dict[str, Any] = {} if name == "langchain-defaults" else {"chunk_size": 32}
    lc = OpenAIEmbeddings(
        model=model,
        base_url=f"{url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
        **extra,
    )
    return lc.embed_documents


# -- the run --------------------------------------------------------------------------------


def _timed_peer(
    tei: _tei.TEIProcess, name: str, model: str, texts_file: Path, dims: int
) -> dict[str, Any]:
    before = tei.stats()
    result = _peers.run(
        Path(__file__),
        [
            "--peer",
            name,
            "--url",
            tei.url,
            "--model",
            model,
            "--texts",
            str(texts_file),
            "--dims",
            str(dims),
        ],
    )
    result["server"] = _tei.stats_delta(before, tei.stats())
    return result


def _rate(result: dict[str, Any]) -> float | None:
    if not result.get("ok") or not result.get("seconds"):
        return None
    return float(result["inputs"]) / float(result["seconds"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="bench/embed_saturation.py",
        description="Client throughput against a saturated TEI stand-in, quarry vs peers.",
    )
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--docs", type=int, default=1200, help="documents to chunk into inputs")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of capacity and quarry")
    parser.add_argument(
        "--peer-rounds", type=int, default=1, help="rounds that also run the peers (slow)"
    )
    parser.add_argument("--no-peers", action="store_true", help="capacity and quarry only")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--texts", type=Path, help=argparse.SUPPRESS)
    _tei.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.peer:
        print(json.dumps(peer_child(args.peer, args.url, args.model, args.texts, args.dims)))
        return {}

    settings = _tei.settings_from(args)
    texts = passages(args.corpus, args.docs)
    peers = [] if args.no_peers else list(PEERS)
    info: dict[str, Any] = {"machine": machine(), "server": settings.to_dict()}
    if peers:
        _peers.ensure()
        info["peer_versions"] = _peers.versions(PEER_PACKAGES)
    log(f"{len(texts):,} inputs from {args.docs:,} SciFact documents; load {load()}")

    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, _tei.TEIProcess(settings) as tei:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        model = json.loads(_get(f"{tei.url}/info"))["model_id"]
        for r in range(args.rounds):
            entry: dict[str, Any] = {"load": load()}
            entry["capacity"] = _tei.measure_capacity(
                tei.url,
                texts,
                batch=settings.max_client_batch_size,
                in_flight_inputs=settings.max_concurrent_requests,
            )
            log(f"round {r + 1}: capacity {entry['capacity']['inputs_per_s']:,.0f} inputs/s")
            before = tei.stats()
            entry["quarry"] = run_quarry(tei.url, texts)
            entry["quarry"]["server"] = _tei.stats_delta(before, tei.stats())
            log(f"round {r + 1}: quarry {_rate(entry['quarry']) or 0:,.0f} inputs/s")
            for name in peers if r < args.peer_rounds else []:
                entry[name] = _timed_peer(tei, name, model, texts_file, settings.dims)
                rate = _rate(entry[name])
                log(
                    f"round {r + 1}: {name} "
                    + (f"{rate:,.0f} inputs/s" if rate else f"failed: {entry[name]['error']}")
                )
            entry["load_after"] = load()
            rounds.append(entry)

    result = summarise(info, texts, rounds, peers, settings)
    print_report(result)
    path = write_result(NAME, result)
    log(f"wrote {path}")
    return result


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


def summarise(
    info: dict[str, Any],
    texts: list[str],
    rounds: list[dict[str, Any]],
    peers: list[str],
    settings: _tei.TEISettings,
) -> dict[str, Any]:
    """Medians over rounds, shares of capacity, ratios and targets."""
    capacities = [r["capacity"]["inputs_per_s"] for r in rounds]
    tokens = sum(r["capacity"]["server"]["tokens"] for r in rounds)
    inputs = sum(r["capacity"]["server"]["inputs_embedded"] for r in rounds)
    avg_tokens = tokens / inputs if inputs else 0.0
    per_step = max(1, int(settings.max_batch_tokens // max(avg_tokens, 1)))
    step_s = (settings.latency_ms + settings.per_token_us * per_step * avg_tokens / 1e3) / 1e3
    clients: dict[str, Any] = {}
    for name in ["quarry", *peers]:
        family, kind, description = (
            ("quarry", "defaults", "EmbeddingClient(url).embed_passages (limits from /info)")
            if name == "quarry"
            else PEERS[name]
        )
        ran = [r for r in rounds if name in r]
        runs = [r[name] for r in ran]
        rates = [_rate(run) for run in runs]
        shares = [
            rate / r["capacity"]["inputs_per_s"]
            for rate, r in zip(rates, ran, strict=True)
            if rate is not None
        ]
        ok_rates = [rate for rate in rates if rate is not None]
        last = runs[-1]
        server = last.get("server", {})
        clients[name] = {
            "family": family,
            "kind": kind,
            "description": description,
            "ok": bool(ok_rates) and len(ok_rates) == len(rates),
            "error": next((run.get("error") for run in runs if not run.get("ok")), None),
            "inputs_per_s": round(statistics.median(ok_rates), 1) if ok_rates else None,
            "inputs_per_s_rounds": [round(rate, 1) if rate else None for rate in rates],
            "share_of_capacity": round(statistics.median(shares), 4) if shares else None,
            "share_rounds": [round(s, 4) for s in shares],
            "requests": server.get("embed_requests"),
            "inputs_per_request": (
                round(server["inputs_embedded"] / server["embed_requests"], 1)
                if server.get("embed_requests") and server.get("inputs_embedded")
                else None
            ),
            "inputs_per_step": server.get("inputs_per_step"),
            "responses": server.get("responses"),
            "settings": last.get("settings"),
        }
    quarry_rate = clients["quarry"]["inputs_per_s"] or 0.0
    for data in clients.values():
        rate = data["inputs_per_s"]
        data["quarry_speedup"] = round(quarry_rate / rate, 2) if rate else None

    best = [c for n, c in clients.items() if n != "quarry" and c["kind"] == "best"]
    defaults = [c for n, c in clients.items() if n != "quarry" and c["kind"] == "defaults"]
    best_peer = max((c["inputs_per_s"] or 0.0 for c in best), default=0.0)
    targets = [
        {
            "target": "quarry >= 90% of capacity",
            "value": _pct(clients["quarry"]["share_of_capacity"]),
            "met": (clients["quarry"]["share_of_capacity"] or 0) >= 0.9,
        }
    ]
    if best:
        targets.append(
            {
                "target": ">= 2x the best-tuned peer",
                "value": f"{quarry_rate / best_peer:.2f}x" if best_peer else "peers failed",
                "met": best_peer == 0 or quarry_rate >= 2 * best_peer,
            }
        )
    for family in sorted({c["family"] for c in defaults}):
        mine = [c for c in defaults if c["family"] == family]
        rate = max((c["inputs_per_s"] or 0.0 for c in mine), default=0.0)
        targets.append(
            {
                "target": f">= 5x {family}'s defaults",
                "value": f"{quarry_rate / rate:.1f}x"
                if rate
                else "defaults fail: " + str(mine[0]["error"])[:80],
                "met": rate == 0 or quarry_rate >= 5 * rate,
            }
        )
    return {
        **info,
        "inputs": len(texts),
        "server_tokens_per_input": round(avg_tokens, 1),
        "model_capacity_inputs_per_s": round(per_step / step_s, 1),
        "capacity_inputs_per_s": round(statistics.median(capacities), 1),
        "capacity_rounds": capacities,
        "load_rounds": [r["load"] for r in rounds],
        "clients": clients,
        "targets": targets,
        "rounds": rounds,
    }


def _pct(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "-"


def print_report(result: dict[str, Any]) -> None:
    """The table, the capacity it is measured against, and the targets."""
    m = result["machine"]
    s = result["server"]
    print(
        f"\nEmbedding saturation: {result['inputs']:,} inputs "
        f"({result['server_tokens_per_input']:.0f} server tokens each), "
        f"server {s['latency_ms']:g} ms + {s['per_token_us']:g} us/token per step of "
        f"<= {s['max_batch_tokens']:,} tokens, {s['max_client_batch_size']} inputs/request, "
        f"{s['max_concurrent_requests']} in flight"
    )
    print(
        f"machine: {m['nproc']} x {m['cpu']}, {m['memory_gib']} GiB; "
        f"load (1/5/15 min) per round {result['load_rounds']}"
    )
    print(
        f"capacity (saturating raw client): {result['capacity_inputs_per_s']:,.0f} inputs/s "
        f"median of {[round(c) for c in result['capacity_rounds']]} "
        f"(the step model alone allows {result['model_capacity_inputs_per_s']:,.0f})\n"
    )
    rows = []
    for name, c in result["clients"].items():
        rows.append(
            [
                name,
                f"{c['inputs_per_s']:,.0f}" if c["inputs_per_s"] else "failed",
                _pct(c["share_of_capacity"]),
                f"{c['quarry_speedup']:.2f}x" if c["quarry_speedup"] else "-",
                c["inputs_per_request"],
                c["inputs_per_step"],
                ", ".join(f"{k}: {v}" for k, v in sorted((c["responses"] or {}).items())),
            ]
        )
    print(
        table(
            [
                "client",
                "inputs/s",
                "of capacity",
                "quarry is",
                "inputs/request",
                "inputs/step",
                "responses",
            ],
            rows,
        )
    )
    for name, c in result["clients"].items():
        if c["error"]:
            print(f"  {name}: {c['error'][:200]}")
    print()
    for t in result["targets"]:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']}")


if __name__ == "__main__":
    main()
