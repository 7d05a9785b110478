"""``make bench``: every benchmark under bench/ in turn, then docs/benchmarks.md from the results.

Each benchmark is a script ``bench/<name>.py`` (files starting with ``_`` are helpers)
run with its defaults by this interpreter (quarry's virtualenv). What it prints is
kept in ``bench/.out/<name>.txt``; what it measured, in ``bench/.out/<name>.json``
(written by the benchmark itself). The page is rendered from those files only, so
``--render-only`` rebuilds it without measuring anything:

* embed_saturation and ingest_throughput get tables, targets and plots;
* retrieval quality comes from ``quarry eval --json`` output saved as
  ``bench/.out/eval-<dataset>.json`` (with and without rerank), which
  ``bench/retrieval_quality.py`` writes (about half an hour: ``--skip
  retrieval_quality`` leaves it out), or a hand-run ``quarry eval``;
* any other benchmark gets its printed report, verbatim.

The plots are drawn with matplotlib from the peers' virtualenv (``bench/.peers``),
so quarry's environment does not need it. Nothing here is a test: a benchmark that
fails is reported on the page and the others still run.

    .venv/bin/python bench/run_all.py [--only NAME ...] [--skip NAME ...] [--render-only]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
from _common import BENCH, OUT, REPO, load, log, machine

DOC = REPO / "docs" / "benchmarks.md"
IMG = REPO / "docs" / "img"
SPECIAL = ("embed_saturation", "ingest_throughput")
QUALITY_HEADING = "## Retrieval quality, with and without rerank"


def benchmarks() -> list[str]:
    """The benchmark scripts under bench/, the two of issues #7 and #8 first."""
    names = sorted(
        p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem != "run_all"
    )
    return [n for n in SPECIAL if n in names] + [n for n in names if n not in SPECIAL]


def run_one(name: str, extra: list[str]) -> dict[str, Any]:
    """Run ``bench/<name>.py``; its output goes to the terminal and to bench/.out/<name>.txt."""
    OUT.mkdir(parents=True, exist_ok=True)
    log(f"\n=== {name} (load {load()}) ===")
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(BENCH / f"{name}.py"), *extra],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = process.wait()
    (OUT / f"{name}.txt").write_text("".join(lines))
    return {
        "name": name,
        "exit": code,
        "seconds": round(time.monotonic() - started, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


RUNS = OUT / "runs.json"


def record_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge ``runs`` into what earlier runs recorded (one entry per benchmark, the
    latest wins), so a page rebuilt after ``--only`` still lists every benchmark; in a
    fresh checkout (no bench/.out/runs.json) the earlier runs are the page's table."""
    known: dict[str, dict[str, Any]] = {}
    if RUNS.exists():
        known = {r["name"]: r for r in json.loads(RUNS.read_text())}
    elif DOC.exists():
        known = {r["name"]: r for r in previous_runs(DOC.read_text())}
    known.update({r["name"]: r for r in runs})
    merged = [known[name] for name in sorted(known)]
    RUNS.write_text(json.dumps(merged, indent=2))
    return merged


# -- the page before ---------------------------------------------------------------------------

KEPT_NOTE = (
    "_Kept from the page before: this checkout has no fresh result for it in `bench/.out/`._"
)


def previous_sections(text: str) -> dict[str, list[str]]:
    """The page's sections (the lines under each ``## `` heading), by heading."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections[line] = []
        elif current is not None:
            current.append(line)
    return sections


def previous_runs(text: str) -> list[dict[str, Any]]:
    """The rows of the page's table of runs (benchmark, exit, seconds, last run)."""
    runs = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].lstrip("-").isdigit():
            seconds = cells[2] if cells[2] != "-" else None
            runs.append(
                {"name": cells[0], "exit": int(cells[1]), "seconds": seconds, "finished": cells[3]}
            )
    return runs


def kept(previous: dict[str, list[str]], heading: str) -> list[str]:
    """A section of the page before, marked as such; [] when it had none."""
    body = [line for line in previous.get(heading, []) if line != KEPT_NOTE]
    while body and not body[0].strip():
        body.pop(0)
    return [heading, "", KEPT_NOTE, "", *body] if body else []


# -- reading results --------------------------------------------------------------------------


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def evals() -> list[dict[str, Any]]:
    """``quarry eval --json`` outputs saved as bench/.out/eval-*.json (a dict or a list of them)."""
    found = []
    for path in sorted(OUT.glob("eval-*.json")):
        data = _json(path)
        for item in data if isinstance(data, list) else [data]:
            if isinstance(item, dict) and "ndcg@10" in item:
                found.append({**item, "_file": path.name})
    return found


# -- plots (drawn in bench/.peers) -------------------------------------------------------------


def plot_specs(
    saturation: dict[str, Any] | None,
    ingest: dict[str, Any] | None,
    quality: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """What to draw, as plain data for the child that has matplotlib."""
    specs: list[dict[str, Any]] = []
    if saturation:
        clients = saturation["clients"]
        labels = list(clients)
        specs.append(
            {
                "file": "embed_saturation.png",
                "kind": "barh",
                "title": "Embedding client throughput against the server's capacity",
                "xlabel": "inputs/s (median of rounds)",
                "labels": labels,
                "values": [clients[n]["inputs_per_s"] or 0 for n in labels],
                "notes": [
                    f"{clients[n]['share_of_capacity']:.0%}"
                    if clients[n]["share_of_capacity"] is not None
                    else "fails"
                    for n in labels
                ],
                "colors": [_color(clients[n]["family"]) for n in labels],
                "vline": saturation["capacity_inputs_per_s"],
                "vline_label": "capacity (saturating raw client)",
            }
        )
    if ingest:
        pipes = ingest["pipelines"]
        labels = list(pipes)
        specs.append(
            {
                "file": "ingest_throughput.png",
                "kind": "barh",
                "title": f"First ingest of {ingest['docs']:,} SciFact documents",
                "xlabel": "chunks/s",
                "labels": labels,
                "values": [pipes[n].get("chunks_per_s") or 0 for n in labels],
                "notes": [
                    f"{pipes[n]['floor_multiple']:.2f}x floor"
                    if pipes[n].get("floor_multiple")
                    else "fails"
                    for n in labels
                ],
                "colors": [_color(pipes[n]["family"]) for n in labels],
                "vline": ingest["capacity_inputs_per_s"],
                "vline_label": "server capacity (the floor's rate)",
            }
        )
        specs.append(
            {
                "file": "ingest_reingest.png",
                "kind": "barh",
                "log": True,
                "title": "Re-ingest of the unchanged corpus",
                "xlabel": "seconds (log scale)",
                "labels": [n for n in labels if pipes[n].get("again_seconds")],
                "values": [
                    pipes[n]["again_seconds"] for n in labels if pipes[n].get("again_seconds")
                ],
                "notes": [
                    _again_note(pipes[n]["again_inputs"])
                    for n in labels
                    if pipes[n].get("again_seconds")
                ],
                "colors": [
                    _color(pipes[n]["family"]) for n in labels if pipes[n].get("again_seconds")
                ],
            }
        )
    if quality:
        groups = []
        for item in quality:
            base = item.get("without_rerank") or (item if not item.get("reranked") else None)
            name = f"{item.get('dataset', '?')} ({item.get('model', {}).get('model_id', '?')})"
            if base:
                groups.append({"label": f"{name}, vector only", "metrics": base})
            if item.get("reranked"):
                groups.append({"label": f"{name}, reranked", "metrics": item})
        specs.append(
            {
                "file": "retrieval_quality.png",
                "kind": "grouped",
                "title": "Retrieval quality with and without rerank (quarry eval)",
                "metrics": ["ndcg@10", "recall@10", "recall@100", "mrr@10"],
                "groups": groups,
            }
        )
    return specs


def _again_note(inputs: int) -> str:
    return "nothing re-embedded" if inputs == 0 else f"{inputs} chunks re-embedded"


def _color(family: str) -> str:
    return {"quarry": "#2b6cb0", "LlamaIndex": "#b7791f", "LangChain": "#2f855a"}.get(
        family, "#718096"
    )


def draw(specs_file: Path) -> None:
    """Runs in bench/.peers: draw every spec into docs/img/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    for spec in json.loads(specs_file.read_text()):
        if spec["kind"] == "barh":
            n = len(spec["labels"])
            fig, ax = plt.subplots(figsize=(8, 0.5 * n + 1.4))
            y = list(range(n))[::-1]
            ax.barh(y, spec["values"], color=spec["colors"])
            ax.set_yticks(y, spec["labels"])
            if spec.get("log"):
                from matplotlib.ticker import FormatStrFormatter, NullFormatter

                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
                ax.xaxis.set_minor_formatter(NullFormatter())
            top = max([*spec["values"], spec.get("vline") or 0, 1e-9])
            for yi, value, note in zip(y, spec["values"], spec["notes"], strict=True):
                ax.text(value if value else top * 0.01, yi, f"  {note}", va="center", fontsize=8)
            if spec.get("vline"):
                ax.axvline(spec["vline"], color="#c53030", linestyle="--", linewidth=1)
                ax.text(
                    spec["vline"],
                    -0.75,
                    f" {spec['vline_label']}",
                    color="#c53030",
                    fontsize=8,
                    va="bottom",
                )
            if not spec.get("log"):
                ax.set_xlim(0, top * 1.3)
            ax.set_xlabel(spec["xlabel"])
            ax.set_title(spec["title"], fontsize=10)
        else:
            metrics, groups = spec["metrics"], spec["groups"]
            fig, ax = plt.subplots(figsize=(8, 3.6))
            width = 0.8 / max(1, len(groups))
            for i, group in enumerate(groups):
                xs = [m + i * width for m in range(len(metrics))]
                values = [float(group["metrics"].get(k) or 0) for k in metrics]
                bars = ax.bar(xs, values, width, label=group["label"])
                ax.bar_label(bars, fmt="%.3f", fontsize=7)
            ax.set_xticks([m + width * (len(groups) - 1) / 2 for m in range(len(metrics))], metrics)
            ax.set_ylim(0, 1.05)
            ax.legend(fontsize=7, loc="lower right")
            ax.set_title(spec["title"], fontsize=10)
        fig.tight_layout()
        fig.savefig(IMG / spec["file"], dpi=110)
        plt.close(fig)


# -- the page ---------------------------------------------------------------------------------


def render(runs: list[dict[str, Any]] | None) -> str:
    """docs/benchmarks.md from bench/.out/ (and the plots, drawn on the way)."""
    saturation = _json(OUT / "embed_saturation.json")
    ingest = _json(OUT / "ingest_throughput.json")
    quality = evals()
    specs = plot_specs(saturation, ingest, quality)
    drawn = _draw(specs)

    # A benchmark with no result here (a fresh checkout, an --only run) keeps its section.
    previous = previous_sections(DOC.read_text()) if DOC.exists() else {}
    host = (saturation or ingest or {}).get("machine") or machine()
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run_all.py`) from the results in `bench/.out/`;",
        "`python bench/run_all.py --render-only` rebuilds this page without measuring.",
        "Benchmarks are measured, never asserted in tests. Peers (LlamaIndex, LangChain) run",
        "in their own virtualenv, `bench/.peers`, from `bench/requirements-peers.txt`.",
        "",
        f"Machine: {host.get('nproc')} x {host.get('cpu')}, {host.get('memory_gib')} GiB, "
        f"Python {host.get('python')}. It is shared with other work: the load average "
        "(1/5/15 min, as `uptime` says) is given with each figure, and figures move by "
        "10-20 % from run to run.",
        "",
    ]
    if runs:
        lines += ["| benchmark | exit | seconds | last run |", "|---|---:|---:|---|"]
        lines += [
            f"| {r['name']} | {r['exit']} | {r.get('seconds') or '-'} | {r.get('finished', '-')} |"
            for r in runs
        ]
        lines.append("")
    if saturation:
        lines += _saturation_section(saturation, "embed_saturation.png" in drawn)
    else:
        lines += kept(previous, "## Embedding saturation (issue #7)")
    if ingest:
        lines += _ingest_section(ingest, drawn)
    else:
        lines += kept(previous, "## Ingest throughput (issue #8)")
    quality_kept = [] if quality else kept(previous, QUALITY_HEADING)
    lines += quality_kept or _quality_section(quality, "retrieval_quality.png" in drawn)
    for name in benchmarks():
        if name in SPECIAL:
            continue
        text = OUT / f"{name}.txt"
        result = OUT / f"{name}.json"
        if not text.exists() and not result.exists() and kept(previous, f"## {name}"):
            lines += kept(previous, f"## {name}")
            continue
        lines += [f"## {name}", ""]
        doc = _docstring(BENCH / f"{name}.py")
        if doc:
            lines += [doc, ""]
        if text.exists() and text.read_text().strip():
            lines += ["What it printed:", "", "```", text.read_text().rstrip(), "```", ""]
        elif result.exists():
            data = _json(result) or {}
            data.pop("machine", None)
            lines += [
                "Its last result (it was not run by `run_all` here):",
                "",
                "```json",
                json.dumps(data, indent=1)[:4000],
                "```",
                "",
            ]
        else:
            lines += ["Not run yet: `python bench/" + name + ".py`.", ""]
        if result.exists():
            lines += [f"Raw figures: `bench/.out/{name}.json`.", ""]
    return "\n".join(lines).rstrip() + "\n"


def _draw(specs: list[dict[str, Any]]) -> set[str]:
    if not specs:
        return set()
    OUT.mkdir(parents=True, exist_ok=True)
    specs_file = OUT / "plots.json"
    specs_file.write_text(json.dumps(specs))
    result = subprocess.run(
        [str(_peers.ensure()), str(Path(__file__)), "--draw", str(specs_file)],
        env=_peers.env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        log(f"plots failed: {result.stderr[-1500:]}")
        return set()
    return {spec["file"] for spec in specs}


def _docstring(path: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError):
        return ""
    return (doc or "").split("\n\n")[0].replace("\n", " ")


def _targets(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | met |", "|---|---|---|"]
    for t in targets:
        value = str(t["value"]).replace("|", "/")
        lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else '**no**'} |")
    return [*lines, ""]


def _server(s: dict[str, Any]) -> str:
    return (
        f"`python -m quarry.local_tei --backend hash --dims {s['dims']} --latency-ms "
        f"{s['latency_ms']:g} --per-token-us {s['per_token_us']:g} --max-batch-tokens "
        f"{s['max_batch_tokens']} --max-client-batch-size {s['max_client_batch_size']} "
        f"--max-concurrent-requests {s['max_concurrent_requests']} --max-input-length "
        f"{s['max_input_length']}` (through `bench/_tei.py`, which adds a read-only "
        "`/bench/stats` route), in its own process"
    )


def _saturation_section(r: dict[str, Any], plot: bool) -> list[str]:
    s = r["server"]
    lines = [
        "## Embedding saturation (issue #7)",
        "",
        "`bench/embed_saturation.py`. How close each client comes to what the embedding "
        "server can do.",
        "",
        f"- **Server**: {_server(s)}. It models TEI: one queue, one worker loop taking up to "
        f"{s['max_batch_tokens']:,} tokens of queued inputs per step, whichever requests they "
        f"came from, each step costing {s['latency_ms']:g} ms + {s['per_token_us']:g} us per "
        f"token; 429 past {s['max_concurrent_requests']} inputs waiting; at most "
        f"{s['max_client_batch_size']} inputs per request (TEI's default).",
        f"- **Inputs**: {r['inputs']:,} passages, SciFact abstracts cut by quarry's chunker "
        f"(256 tokens, 32 overlap); {r['server_tokens_per_input']:.0f} server tokens each.",
        "- **Capacity**: inputs/s of a saturating raw client (requests of "
        f"{s['max_client_batch_size']} inputs, {s['max_concurrent_requests']} inputs in flight, "
        "bodies encoded before the clock starts, answers not decoded), measured in every "
        f"round: {', '.join(f'{c:,.0f}' for c in r['capacity_rounds'])} inputs/s (median "
        f"{r['capacity_inputs_per_s']:,.0f}). The step model alone would allow "
        f"{r['model_capacity_inputs_per_s']:,.0f}: the rest is the stand-in's own CPU "
        "(tokenizing, HTTP) on a shared 2-core machine.",
        "- **Clients**: each embeds all the inputs in one call after a one-input warm-up; "
        "only that call is timed. Share of capacity is taken against the capacity measured "
        "in the same round; medians over rounds. The server's counters say what each "
        "client sent.",
        f"- **Load** (1/5/15 min) per round: {r['load_rounds']}.",
        "",
        "| client | settings | inputs/s | of capacity | quarry is | inputs/request | "
        "inputs/step | responses |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in r["clients"].items():
        responses = ", ".join(f"{k}: {v}" for k, v in sorted((c["responses"] or {}).items()))
        rate = f"{c['inputs_per_s']:,.0f}" if c["inputs_per_s"] else "fails"
        share = f"{c['share_of_capacity']:.0%}" if c["share_of_capacity"] is not None else "-"
        speedup = f"{c['quarry_speedup']:.2f}x" if c["quarry_speedup"] else "-"
        lines.append(
            f"| {name} | {c['description']} | {rate} | {share} | {speedup} | "
            f"{c['inputs_per_request'] or '-'} | {c['inputs_per_step'] or '-'} | {responses} |"
        )
    lines.append("")
    errors = [(n, c["error"]) for n, c in r["clients"].items() if c["error"]]
    for name, error in errors:
        lines.append(f"- {name}: `{str(error)[:200]}`")
    if errors:
        lines.append("")
    if plot:
        lines += ["![Embedding throughput](img/embed_saturation.png)", ""]
    lines += ["Targets:", "", *_targets(r["targets"]), *_saturation_findings(r)]
    if r.get("peer_versions"):
        versions = ", ".join(f"{k} {v}" for k, v in r["peer_versions"].items())
        lines += [f"Peer versions: {versions}.", ""]
    return lines


def _saturation_findings(r: dict[str, Any]) -> list[str]:
    """What the server's counters say about each client, from this run."""
    c = r["clients"]
    s = r["server"]
    full = int(s["max_batch_tokens"] // max(r["server_tokens_per_input"], 1))
    lines = ["Findings from this run:", ""]
    q = c.get("quarry") or {}
    if q.get("inputs_per_s"):
        settings = q.get("settings") or {}
        lines.append(
            f"- quarry sizes requests and concurrency from `/info`: "
            f"{settings.get('batch_size', '?')} inputs per request, "
            f"{settings.get('concurrency', '?')} requests in flight "
            f"({s['max_concurrent_requests']} inputs), so the server's steps stay full "
            f"({q['inputs_per_step']} inputs per step; about {full} fit in "
            f"{s['max_batch_tokens']:,} tokens)."
        )
    serial = [
        n
        for n in ("llamaindex-defaults", "llamaindex-best-sync", "langchain-best")
        if (c.get(n) or {}).get("inputs_per_s")
    ]
    if serial:
        lines.append(
            "- Serial clients ("
            + ", ".join(serial)
            + ") have one request queued at a time: each step carries one request "
            "(inputs per step = inputs per request) and pays the fixed "
            f"{s['latency_ms']:g} ms for it."
        )
    la = c.get("llamaindex-best-async") or {}
    if la.get("inputs_per_s"):
        lines.append(
            f"- LlamaIndex's async path keeps 16 requests in flight ({la['inputs_per_step']} "
            "inputs per step) but opens a new HTTP client for every request and parses "
            "JSON floats: its own CPU, not the server, caps it at "
            f"{la['share_of_capacity']:.0%}."
        )
    ld = c.get("langchain-defaults") or {}
    if ld and not ld.get("inputs_per_s"):
        lines.append(
            "- LangChain's defaults send `chunk_size=1000` inputs per request; TEI accepts "
            f"{s['max_client_batch_size']} (`--max-client-batch-size`) and answers 422."
        )
    return [*lines, ""]


def _ingest_section(r: dict[str, Any], drawn: set[str]) -> list[str]:
    s = r["server"]
    caps = ", ".join(f"{c['inputs_per_s']:,.0f} (load {c['load'][0]})" for c in r["capacity_runs"])
    lines = [
        "## Ingest throughput (issue #8)",
        "",
        "`bench/ingest_throughput.py`. From files on disk to vectors in Qdrant, then the "
        "same again with nothing changed.",
        "",
        f"- **Corpus**: the first {r['docs']:,} SciFact abstracts, one `.txt` file each "
        "(title, blank line, text) in a temporary folder; every pipeline chunks at 256 "
        "tokens with 32 of overlap (cl100k_base) with its own splitter and embeds what its "
        f"splitter makes (quarry: {r['quarry_chunks']:,} chunks).",
        f"- **Server**: {_server(s)}.",
        f"- **Floor**: quarry's chunks at the server's capacity, measured three times in the "
        f"run with a saturating raw client: {caps} inputs/s, median "
        f"{r['capacity_inputs_per_s']:,.0f}: **{r['floor_seconds']:.2f} s** (the step model "
        f"alone: {r['model_floor_seconds']:.2f} s). Each pipeline's time is given as a "
        "multiple of the floor for its own number of chunks.",
        "- **quarry**: `IndexSync` + `run_sync` with its defaults, batches of documents "
        "submitted to 4 threads (`QUARRY_WORKERS`), as the Prefect flow submits its tasks; "
        "Qdrant in memory (`QdrantClient(':memory:')` in `quarry.store.VectorStore`) and "
        "local mode on disk (`open_client(settings)`, a folder under /tmp on the machine's "
        "disk). `quarry-flow-disk` (unless `--no-flow`) is the Prefect flow itself, in a child "
        "process with ephemeral Prefect; its startup is timed apart.",
        "- **LlamaIndex**: `SimpleDirectoryReader(filename_as_id=True)` -> "
        "`IngestionPipeline([SentenceSplitter(256, 32), TextEmbeddingsInference], "
        "vector_store=QdrantVectorStore, docstore=SimpleDocumentStore())`, Qdrant in memory.",
        "- **LangChain**: the files as `Document`s -> "
        "`RecursiveCharacterTextSplitter.from_tiktoken_encoder(256, 32)` -> `index(..., "
        "cleanup='incremental', source_id_key='source')` into `langchain_qdrant."
        "QdrantVectorStore` with `OpenAIEmbeddings(check_embedding_ctx_length=False)` and "
        "`InMemoryRecordManager` (the record manager that matches an in-memory Qdrant).",
        "- **Re-ingest**: the same pipeline over the same store (and docstore / record "
        "manager) with the corpus unchanged, three times; the fastest is shown. The server "
        "counts what each pipeline asks it to embed.",
        "",
        "| pipeline | settings | chunks | first ingest s | client CPU s | chunks/s | x floor | "
        "quarry is | re-ingest s | re-ingest requests / inputs | first / re-ingest |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in r["pipelines"].items():
        if not e.get("chunks_per_s"):
            lines.append(f"| {name} | {e['description']} | fails | - | - | - | - | - | - | - | - |")
            continue
        cpu = f"{e['first_cpu_seconds']:.2f}" if e.get("first_cpu_seconds") else "-"
        speedup = f"{e['quarry_speedup']:.2f}x" if e.get("quarry_speedup") else "-"
        lines.append(
            f"| {name} | {e['description']} | {e['chunks']:,} | {e['first_seconds']:.2f} | "
            f"{cpu} | {e['chunks_per_s']:,.0f} | {e['floor_multiple']:.2f}x | {speedup} | "
            f"{e['again_seconds']:.2f} | {e['again_requests']} / {e['again_inputs']} | "
            f"{e['again_speedup']:.1f}x |"
        )
    lines.append("")
    for name, e in r["pipelines"].items():
        if e.get("error"):
            lines.append(f"- {name}: `{str(e['error'])[:200]}`")
        if e.get("startup_seconds"):
            lines.append(
                f"- {name}: Prefect's startup (a no-op flow in a fresh process) took "
                f"{e['startup_seconds']:.1f} s, not included above."
            )
        if e.get("noop_run_seconds"):
            lines.append(
                f"- {name}: once Prefect is up, a no-op flow run takes "
                f"{e['noop_run_seconds']:.2f} s (creating the run and its state changes): "
                "no flow run, a re-ingest included, takes less."
            )
    b = r.get("client_cpu_budget")
    if b:
        lines += [
            f"- quarry's client-side CPU, stage by stage, each alone on one thread: loading "
            f"{b['documents']:,} files {b['load_cpu_s']:.2f} s, chunking {b['chunk_cpu_s']:.2f} s, "
            f"writing {b['points']:,} points to in-memory Qdrant {b['upsert_memory_cpu_s']:.2f} s; "
            f"local mode on disk costs {b['upsert_disk_ms_per_point']:.2f} ms per point of wall "
            f"time, written as quarry writes it (SQLite in WAL mode with synchronous=NORMAL, "
            f"one commit per upsert). The floor is {r['floor_seconds']:.2f} s.",
        ]
    lines.append("")
    for file, alt in (
        ("ingest_throughput.png", "First ingest"),
        ("ingest_reingest.png", "Re-ingest"),
    ):
        if file in drawn:
            lines += [f"![{alt}](img/{file})", ""]
    lines += ["Targets:", "", *_targets(r["targets"]), *_ingest_findings(r)]
    if r.get("peer_versions"):
        versions = ", ".join(f"{k} {v}" for k, v in r["peer_versions"].items())
        lines += [f"Peer versions: {versions}.", ""]
    return lines


def _ingest_findings(r: dict[str, Any]) -> list[str]:
    """Why the figures are what they are: computed from this run, plus profiling notes."""
    pipes = r["pipelines"]
    mem, disk = (pipes.get(n) or {} for n in ("quarry-memory", "quarry-disk"))
    b = r.get("client_cpu_budget") or {}
    lines = ["Findings from this run:", ""]
    if mem.get("first_seconds") and b:
        stages = b["load_cpu_s"] + b["chunk_cpu_s"] + b["upsert_memory_cpu_s"]
        cpu = mem.get("first_cpu_seconds") or 0.0
        bound = (
            "its own CPU time alone exceeds the floor, and most of it is Python code that "
            "runs under one interpreter lock"
            if cpu > r["floor_seconds"]
            else f"its CPU time is {cpu / r['floor_seconds']:.0%} of the floor"
        )
        lines.append(
            f"- In memory, quarry's first ingest took {mem['first_seconds']:.1f} s and "
            f"{cpu:.1f} CPU-seconds of its own process against a floor of "
            f"{r['floor_seconds']:.1f} s: {bound}. Loading, chunking and writing alone cost "
            f"{stages:.1f} CPU-seconds on one thread; the rest is HTTP and decoding of "
            f"{mem['first_requests']} requests, building points and hand-offs between "
            f"threads. The {r['machine']['nproc']} cores are shared with the server (itself "
            f"CPU-bound: {r['capacity_inputs_per_s']:,.0f} inputs/s against the step model's "
            f"{r['quarry_chunks'] / max(r['model_floor_seconds'], 1e-9):,.0f}) and other "
            f"work; the server ran {mem['inputs_per_step']} inputs per step against about "
            f"{int(r['server']['max_batch_tokens'] // max(r['server_tokens_per_input'], 1))} "
            "when saturated: it was waiting for quarry."
        )
    if disk.get("first_seconds") and b:
        writes = b["upsert_disk_ms_per_point"] * disk["chunks"] / 1e3
        lines.append(
            f"- On disk, local-mode Qdrant (qdrant-client's SQLite persistence) commits once "
            f"per point; with the default rollback journal each commit was an fsync (16.8 ms "
            f"per point on this disk when first measured, a 19x-the-floor ingest). quarry "
            f"switches its SQLite to WAL with synchronous=NORMAL (0.43 ms per point), and "
            f"commits each upsert once instead of once per point (store.py): "
            f"{b['upsert_disk_ms_per_point']:.2f} ms per point here, {writes:.1f} s of writes "
            f"for {disk['chunks']:,} points, overlapped with embedding (first ingest "
            f"{disk['first_seconds']:.1f} s, {disk['floor_multiple']:.2f}x the floor)."
        )
    if mem.get("again_seconds"):
        lines.append(
            f"- quarry's re-ingest sent {mem['again_requests']} embedding requests: `/info` "
            "settles the model and serving identity, and the fingerprint canary is embedded "
            "only before a run's first passage (tests/test_flow_ingest.py expects zero). It "
            "reads no file whose mtime and size are those its points were written from "
            "(`QUARRY_TRUST_FILE_STAMPS`); its "
            f"{mem['again_seconds']:.2f} s go to listing and stat-ing the files, reading every "
            "point's state from Qdrant, and starting the clients."
        )
    flow = pipes.get("quarry-flow-disk") or {}
    if flow.get("again_seconds") and mem.get("again_seconds"):
        lines.append(
            f"- Through the Prefect flow, the same sync takes {flow['first_seconds']:.1f} s "
            f"first and {flow['again_seconds']:.2f} s again: the difference from the plain "
            "sync is Prefect's per-run work (the flow run, a task run per batch of documents, "
            "the summary artifact, all against its API server), not embedding or Qdrant."
            + (
                f" A flow run that does nothing takes {flow['noop_run_seconds']:.2f} s."
                if flow.get("noop_run_seconds")
                else ""
            )
            + " Under embedded Prefect, quarry runs flows without flow-run heartbeats: their "
            "thread, which sleeps in one-second steps, held every run's exit for up to a "
            "second, and only a Prefect server can use them."
        )
    lc = pipes.get("langchain-best") or {}
    if lc.get("again_inputs"):
        lines.append(
            f"- LangChain's re-ingest of the unchanged corpus re-embedded "
            f"{lc['again_inputs']} chunks in {lc['again_requests']} requests: chunks of "
            "documents that straddle its batches (`index(batch_size=100)`), deleted by the "
            "per-batch incremental cleanup and added again on every run "
            "(langchain-ai/langchain#32612)."
        )
    lines += [
        "",
        "Profiling notes (py-spy and cProfile, at the time of writing):",
        "",
        "- Fixed: the sync deleted stale chunks with a filtered delete per document, also "
        "for documents that had no points; local mode evaluates the filter on every point, "
        "so a first ingest was quadratic (500 documents: 34 of 42 s). "
        "`IndexSync` now skips it for documents the plan saw no points of.",
        "- Fixed: the embedding client counted tiktoken tokens of every input before sending "
        "the first request (about 1 ms per chunk here). It now counts only when a batch "
        "could exceed `max_batch_tokens` (never with TEI's defaults, 32 x 512 = 16,384), "
        "sends batches as they are sized, and shares one pool of `concurrency` threads "
        "between all callers: before, each call had its own pool, so 4 concurrent "
        "batches of documents (Prefect tasks) could put 4 x 16 requests in flight, "
        "past the server's 512 inputs, and collect 429s.",
        "- Fixed: `/tokenize` was called for every batch before it was sent, and its answer "
        "(every token with its text and offsets) cost more to parse than the embeddings "
        "(81% of capacity in the saturation benchmark). Batches now go out as they are; a "
        "422 for an over-long input gets one `/tokenize` call and a split where the count "
        "says, and only a corpus where 422s are common is counted first. Each HTTP client "
        "built its own "
        "TLS context (a CA-bundle load, ~50 ms); one per process now. The loader resolved "
        "every walked path again; it opens what the walk found with `O_NOFOLLOW` instead.",
        "- Fixed: re-ingest read the index state through a filtered scroll, which local mode "
        "re-evaluates in Python for every page of 1,024 points (quadratic: 7.8 s for 20,000 "
        "points); it now reads one unfiltered page in local mode. It also read and hashed "
        "every file; files whose stamp (mtime, size) is as indexed are now skipped unread.",
        "- Fixed: that unfiltered page still deep-copied every payload (local mode copies "
        "what a scroll returns): most of a re-ingest. In local mode the state is now read "
        "from qdrant-client's in-process payloads without a copy (0.15 -> 0.05 s here), "
        "with the scroll kept as the fallback.",
        "- Fixed: chunking ran tiktoken's BPE over every unit. It now counts by tiktoken's "
        "pre-tokenizer pieces with a cache of per-piece counts (`quarry._pieces`; same "
        "chunks, checked against encoding), 0.6 -> 0.4-0.5 CPU-s for this corpus from a cold "
        "cache. Each file was read with a 20 MB buffer (the size limit); now with the size "
        "fstat reports (load 0.23 -> 0.17 CPU-s). Per-document payload fields, among them "
        "`model_key` (a JSON hash), were computed once per point.",
        "",
    ]
    return lines


def _quality_section(quality: list[dict[str, Any]], plot: bool) -> list[str]:
    lines = [QUALITY_HEADING, ""]
    if not quality:
        return [
            *lines,
            "No `quarry eval` result yet: `python bench/retrieval_quality.py` makes one "
            "(or save `quarry eval DATASET --json` as `bench/.out/eval-<dataset>.json`), "
            "then `python bench/run_all.py --render-only`. See docs/evaluation.md.",
            "",
        ]
    metrics = ["ndcg@10", "recall@10", "recall@100", "mrr@10"]
    lines += [
        "From `quarry eval --json` output in `bench/.out/eval-*.json`, written by "
        "`bench/retrieval_quality.py` (below: the comparison with the model applied "
        "directly, measured in the same run); method: docs/evaluation.md.",
        "",
        "| file | dataset | model | queries | ranking | " + " | ".join(metrics) + " |",
        "|---|---|---|---:|---|" + "---:|" * len(metrics),
    ]
    for item in quality:
        model = (item.get("model") or {}).get("model_id", "?")
        rows = []
        base = item.get("without_rerank") or (item if not item.get("reranked") else None)
        if base:
            rows.append(("vector only", base))
        if item.get("reranked"):
            rows.append(("reranked", item))
        for label, values in rows:
            cells = " | ".join(f"{float(values.get(m) or 0):.3f}" for m in metrics)
            lines.append(
                f"| {item['_file']} | {item.get('dataset', '?')} | {model} | "
                f"{item.get('queries', '?')} | {label} | {cells} |"
            )
    lines.append("")
    if plot:
        lines += ["![Retrieval quality](img/retrieval_quality.png)", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench/run_all.py", description="Run every benchmark, then write docs/benchmarks.md."
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these benchmarks")
    parser.add_argument("--skip", nargs="*", default=[], help="do not run these benchmarks")
    parser.add_argument("--render-only", action="store_true", help="measure nothing")
    parser.add_argument(
        "--no-flow", dest="flow", action="store_false", help="ingest_throughput --no-flow"
    )
    parser.add_argument("--draw", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.draw:
        draw(args.draw)
        return
    runs: list[dict[str, Any]] = []
    if not args.render_only:
        for name in benchmarks():
            if (args.only is not None and name not in args.only) or name in args.skip:
                continue
            extra = ["--no-flow"] if name == "ingest_throughput" and not args.flow else []
            runs.append(run_one(name, extra))
    OUT.mkdir(parents=True, exist_ok=True)
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(record_runs(runs)))
    log(f"wrote {DOC}")


if __name__ == "__main__":
    main()
