"""Retrieval quality with and without rerank, against the model applied directly (issue #8).

In one run, on a BEIR-layout dataset (default: the SciFact set in ../shared/eval):

* **the reference**: the dataset's ``../reference_eval.py``, the bundled
  all-MiniLM-L6-v2 applied directly (each document embedded whole, the model's own
  truncation, cosine), run by this interpreter;
* **quarry**: ``quarry eval DATASET --json`` on the embedded default (local_tei
  in-process, local-mode Qdrant in a fresh temporary folder, so the corpus is
  chunked, embedded and indexed in the run), both rankings.

It prints both, the difference, and the faithfulness target (quarry's vector-only
nDCG@10 within 0.01 of the reference). quarry's JSON is saved as
``bench/.out/eval-<dataset>.json``, from which ``run_all`` draws the quality plot;
the comparison goes to ``bench/.out/retrieval_quality.json``. On two cores this
takes about half an hour (27 minutes at a load of 1-2), most of it embedding the
corpus twice on CPU.

    .venv/bin/python bench/retrieval_quality.py [DATASET] [--reference SCRIPT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_CORPUS, OUT, load, log, machine, write_result

TOLERANCE = 0.01
METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10")


def _last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            if isinstance(data, dict):
                return data
    raise ValueError("no JSON line in its output")


def run_reference(script: Path, dataset: Path) -> dict[str, Any]:
    """The model applied directly: the reference script's JSON, and how long it took."""
    log(f"reference: {script} {dataset} (load {load()})")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(dataset)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return {**_last_json_line(done.stdout), "seconds": round(time.monotonic() - started, 1)}


def run_quarry_eval(dataset: Path) -> dict[str, Any]:
    """``quarry eval --json`` on the embedded default, in a Qdrant folder of its own."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for name in ("QUARRY_EMBED_URL", "QUARRY_RERANK_URL", "QUARRY_QDRANT_URL"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="quarry-eval-") as data_dir:
        env["QUARRY_DATA_DIR"] = data_dir
        log(f"quarry eval {dataset} --json, QUARRY_DATA_DIR={data_dir} (load {load()})")
        started = time.monotonic()
        # Progress and the table go to stderr, straight to the terminal.
        done = subprocess.run(
            [sys.executable, "-m", "quarry", "eval", str(dataset), "--json"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"quarry eval exited {done.returncode}: {done.stdout.strip()[-2000:]}")
    result = json.loads(done.stdout)
    result["wall_s"] = round(time.monotonic() - started, 1)
    return dict(result)


def report(reference: dict[str, Any], quarry: dict[str, Any]) -> dict[str, Any]:
    """Print the comparison; return what is saved."""
    vector = quarry.get("without_rerank") or quarry
    reranked = quarry if quarry.get("reranked") else None
    ref = float(reference["ndcg@10"])
    rows: list[tuple[str, dict[str, Any]]] = [("the model applied directly", reference)]
    rows.append(("quarry, vector only", vector))
    if reranked is not None:
        rows.append(("quarry, reranked", reranked))
    print(f"{'run':<30}" + "".join(f"{m:>12}" for m in METRICS) + f"{'vs reference':>14}")
    print("-" * (30 + 12 * len(METRICS) + 14))
    for label, values in rows:
        cells = "".join(
            f"{float(values[m]):>12.5f}" if values.get(m) is not None else f"{'-':>12}"
            for m in METRICS
        )
        delta = "" if values is reference else f"{float(values['ndcg@10']) - ref:>+14.4f}"
        print(f"{label:<30}{cells}{delta}")
    gap = float(vector["ndcg@10"]) - ref
    met = abs(gap) <= TOLERANCE
    ingest = quarry.get("ingest") or {}
    timings = quarry.get("timings_s") or {}
    print()
    print(
        f"quarry: {ingest.get('documents_seen')} documents, {ingest.get('points')} points, "
        f"{quarry.get('queries')} queries; ingest {timings.get('ingest_s')} s, search "
        f"{timings.get('search_s')} s, rerank {timings.get('rerank_s')} s "
        f"(wall {quarry.get('wall_s')} s); reference {reference.get('seconds')} s"
    )
    side = "above" if gap > 0 else "below"
    print(
        f"target: quarry's vector-only nDCG@10 within {TOLERANCE} of the model applied "
        f"directly: {gap:+.4f} ({side}) -> {'met' if met else 'MISSED'}"
    )
    return {
        "reference": reference,
        "quarry": {k: v for k, v in quarry.items() if k != "warnings"},
        "warnings": quarry.get("warnings", []),
        "ndcg10_gap": round(gap, 5),
        "target": {"tolerance": TOLERANCE, "met": met},
    }


def main() -> int:
    """Run both evaluations and print the comparison; returns the exit code."""
    parser = argparse.ArgumentParser(prog="bench/retrieval_quality.py", description=__doc__)
    parser.add_argument("dataset", nargs="?", type=Path, default=DEFAULT_CORPUS.parent)
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="the reference script (default: reference_eval.py beside the dataset's folder)",
    )
    args = parser.parse_args()
    dataset: Path = args.dataset.resolve()
    script: Path = args.reference or dataset.parent / "reference_eval.py"
    if not (dataset / "corpus.jsonl").is_file():
        print(f"retrieval_quality: no corpus.jsonl in {dataset}", file=sys.stderr)
        return 2
    if not script.is_file():
        print(f"retrieval_quality: no reference script at {script}", file=sys.stderr)
        return 2
    host = machine()
    print(
        f"retrieval quality on {dataset} ({dataset.name}): the model applied directly "
        f"({script.name}) and quarry eval on the embedded default, in one run; "
        f"{host['nproc']} CPUs, load {host['load']}"
    )
    print()
    try:
        reference = run_reference(script, dataset)
        quarry = run_quarry_eval(dataset)
    except (RuntimeError, ValueError) as exc:
        print(f"retrieval_quality: {exc}", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"eval-{dataset.name}.json").write_text(json.dumps(quarry, indent=1) + "\n")
    saved = report(reference, quarry)
    write_result("retrieval_quality", {"machine": host, "dataset": str(dataset), **saved})
    return 0


if __name__ == "__main__":
    sys.exit(main())
