"""What every benchmark shares: where results go, the machine it ran on, the corpus, a table.

Standard library only: this module is imported both by quarry's environment and by
the peers' (``bench/.peers``), where quarry is not installed.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / ".out"
DEFAULT_CORPUS = Path("/work/shared/eval/scifact/corpus.jsonl")


def machine() -> dict[str, Any]:
    """nproc, CPU model, memory and load average: printed and stored with every result."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        match = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        if match:
            memory_gib = round(int(match.group(1)) / 2**20, 1)
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load": load(),
    }


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages (what ``uptime`` says)."""
    return [round(x, 2) for x in os.getloadavg()]


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/.out/<name>.json`` and return its path."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    data = {"benchmark": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **data}
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def read_corpus(path: Path, limit: int) -> Iterator[dict[str, str]]:
    """The first ``limit`` documents of a BEIR ``corpus.jsonl`` (``_id``, ``title``, ``text``)."""
    with path.open(encoding="utf-8") as handle:
        for count, line in enumerate(handle):
            if count >= limit:
                return
            row = json.loads(line)
            yield {"id": str(row["_id"]), "title": row.get("title") or "", "text": row["text"]}


def write_corpus_files(path: Path, limit: int, folder: Path) -> list[Path]:
    """Write each document as ``<id>.txt`` (title line, blank line, text) under ``folder``.

    The data stays outside the repository: ``folder`` is a temporary directory.
    """
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for doc in read_corpus(path, limit):
        target = folder / f"{doc['id']}.txt"
        body = f"{doc['title']}\n\n{doc['text']}\n" if doc["title"] else f"{doc['text']}\n"
        target.write_text(body, encoding="utf-8")
        files.append(target)
    return files


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, right-aligned numbers, for the terminal."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(
                value.rjust(w) if _numeric(value) else value.ljust(w)
                for value, w in zip(row, widths, strict=True)
            )
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d,.]+[x%]?", text))


def log(message: str) -> None:
    """Progress on stderr (stdout carries tables and, for peer children, JSON)."""
    print(message, file=sys.stderr, flush=True)
