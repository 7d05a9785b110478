"""Memory for one big text file: ``quarry chunk --json`` and ``quarry ingest``.

Usage (with quarry's virtualenv)::

    python bench/big_file_memory.py [--corpus ../shared/eval/scifact/corpus.jsonl] [--mb 60]

Builds one text file of ``--mb`` MB from the corpus's abstracts (title, blank line,
text, in turn, outside the repository), then measures the peak resident memory of:

- ``quarry chunk FILE --json`` (to /dev/null);
- ``quarry ingest FILE`` into a fresh local-mode collection, embedding with the
  stand-in server (``local_tei --backend hash``, no added latency);
- the same ingest with the document written whole (every chunk embedded before the
  first write: ``quarry.ingest.LONG_DOCUMENT_CHUNKS`` raised past its chunk count),
  the way quarry wrote a document before long ones were written in windows;
Each figure is the peak minus the same command's peak on a one-line file (imports,
the tokenizer, Prefect), as a multiple of the file's size. An ingest's figure holds
local-mode Qdrant's own copy of every point (vectors, payloads with their text):
that share is the store's, and a Qdrant server takes it out of the process.

Targets (issue #3: a 200 MB file does not need several times its size):
``chunk --json`` within 3.5x the file (the bytes read and the decoded text are 3x
by themselves once a character is outside Latin-1: Python then stores 2 bytes a
character), and the windowed ingest below the whole-document write. A benchmark,
not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_CORPUS, machine, read_corpus, table, write_result
from _tei import TEIProcess, TEISettings

# The peak resident memory of a command run as a child of a fresh interpreter (its
# own descendants, Prefect's temporary server among them, count as the largest one).
_MEASURE = (
    "import resource, subprocess, sys; "
    "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
)
_WHOLE = (
    "import sys, quarry.ingest; quarry.ingest.LONG_DOCUMENT_CHUNKS = 10**12; "
    "from quarry.cli import main; sys.argv[0] = 'quarry'; main()"
)


def peak_rss(command: list[str], env: dict[str, str]) -> int:
    """Peak resident bytes of ``command``."""
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, *command],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def build_file(corpus: Path, megabytes: float, path: Path) -> int:
    """Write abstracts from ``corpus`` in turn until ``path`` holds ``megabytes`` MB."""
    target = int(megabytes * 1_000_000)
    documents = list(read_corpus(corpus, 10**9))
    size = 0
    with path.open("w", encoding="utf-8") as handle:
        while size < target:
            for doc in documents:
                block = f"{doc['title']}\n\n{doc['text']}\n\n"
                handle.write(block)
                size += len(block.encode("utf-8"))
                if size >= target:
                    break
    return size


def main() -> None:
    """Measure and print; write bench/.out/big_file_memory.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--dims", type=int, default=1024, help="Qwen3-Embedding-0.6B's")
    args = parser.parse_args()

    quarry = [sys.executable, "-m", "quarry"]
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"machine": machine(), "mb": args.mb, "dims": args.dims}
    settings = TEISettings(dims=args.dims, latency_ms=0.0, per_token_us=0.0)
    with tempfile.TemporaryDirectory(prefix="quarry-bigfile-") as tmp, TEIProcess(settings) as tei:
        work = Path(tmp)
        (work / "big").mkdir()
        (work / "small").mkdir()
        size = build_file(args.corpus, args.mb, work / "big" / "big.txt")
        (work / "small" / "small.txt").write_text("One short line.\n", encoding="utf-8")
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("QUARRY_")}
        base_env.update(
            {
                "QUARRY_EMBED_URL": tei.url,
                "QUARRY_MAX_FILE_BYTES": str(size * 2),
                "PREFECT_LOGGING_LEVEL": "WARNING",
            }
        )

        def ingest_env(name: str) -> dict[str, str]:
            return {**base_env, "QUARRY_DATA_DIR": str(work / f"data-{name}")}

        def measured(label: str, big: list[str], small: list[str], env: Any) -> int:
            above = peak_rss(big, env("big")) - peak_rss(small, env("small"))
            rows.append([label, round(above / 1e6), round(above / size, 2)])
            results[label] = {"bytes_above_baseline": above, "times_file": above / size}
            print(f"{label}: {above / 1e6:.0f} MB above its baseline", flush=True)
            return above

        def chunk_env(_name: str) -> dict[str, str]:
            return base_env

        chunk = measured(
            "quarry chunk --json",
            [*quarry, "chunk", str(work / "big" / "big.txt"), "--json"],
            [*quarry, "chunk", str(work / "small" / "small.txt"), "--json"],
            chunk_env,
        )
        ingest = measured(
            "quarry ingest (windows of 4,096 chunks)",
            [*quarry, "ingest", str(work / "big"), "--json"],
            [*quarry, "ingest", str(work / "small"), "--json"],
            ingest_env,
        )
        for name in ("big", "small"):  # the same runs again, from empty collections
            subprocess.run(["rm", "-rf", str(work / f"data-{name}")], check=True)
        whole = measured(
            "quarry ingest, document written whole",
            [sys.executable, "-c", _WHOLE, "ingest", str(work / "big"), "--json"],
            [sys.executable, "-c", _WHOLE, "ingest", str(work / "small"), "--json"],
            ingest_env,
        )
    print()
    print(f"file: {size / 1e6:.1f} MB of text, {args.dims}-dimensional vectors")
    print(table(["peak memory above a one-line file", "MB", "x file"], rows))
    print()
    verdicts = [
        ("chunk --json within 3.5x the file", chunk / size <= 3.5),
        ("windowed ingest below the whole-document write", ingest < whole),
    ]
    for label, met in verdicts:
        print(f"target: {label}: {'met' if met else 'MISSED'}")
    print(f"whole-document write / windowed ingest: {whole / max(ingest, 1):.2f}x the memory")
    results["targets"] = dict(verdicts)
    write_result("big_file_memory", results)


if __name__ == "__main__":
    main()
