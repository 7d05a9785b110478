"""Killing an ingest at any moment and running it again gives exactly the index one
clean run gives: no duplicates, no orphans, nothing missing (point by point)."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quarry.config import Settings
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from quarry.store import VectorStore, open_client
from tests import _crash_runner
from tests.conftest import write_corpus

RUNNER = Path(__file__).with_name("_crash_runner.py")


def corpus_v1() -> dict[str, str]:
    return {
        f"doc{i:02d}.md": f"# Document {i}\n\n"
        + f"Sentence {i} about subject {i % 5}. " * (10 + 7 * i)
        for i in range(14)
    }


def corpus_v2() -> dict[str, str]:
    files = corpus_v1()
    for i in (1, 4, 7):  # shrink: stale chunks to delete
        files[f"doc{i:02d}.md"] = f"# Document {i}\n\nNow short."
    for i in (2, 9):  # grow
        files[f"doc{i:02d}.md"] += "Appended text. " * 80
    for i in (3, 11):  # gone: documents to delete
        del files[f"doc{i:02d}.md"]
    files["new/added.md"] = "# Added\n\n" + "A new document. " * 60
    return files


def snapshot(data: Path) -> dict[str, tuple[dict[str, Any], tuple[float, ...]]]:
    store = VectorStore(open_client(Settings(data_dir=data, collection="crash")), "crash")
    try:
        out = {}
        for record in store.scroll(with_vectors=True):
            payload = dict(record.payload or {})
            payload.pop("ingested_at")  # when, not what
            payload["metadata"] = {
                k: v for k, v in payload["metadata"].items() if k not in ("mtime", "loaded_at")
            }
            vector = tuple(round(x, 6) for x in record.vector)  # type: ignore[union-attr]
            out[str(record.id)] = (payload, vector)
        return out
    finally:
        store.close()


@pytest.fixture(scope="module")
def tei() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16)) as server:
        yield server


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tei: LocalTEIServer) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference")
    corpus = write_corpus(root / "corpus", corpus_v2())
    _crash_runner.run(root / "data", corpus, tei.url)
    return snapshot(root / "data")


def prepare_v1_then_v2(root: Path, url: str) -> tuple[Path, Path]:
    """An index of corpus v1, and the corpus folder rewritten to v2 (not yet synced)."""
    corpus = write_corpus(root / "corpus", corpus_v1())
    data = root / "data"
    _crash_runner.run(data, corpus, url)
    shutil.rmtree(corpus)
    write_corpus(corpus, corpus_v2())
    return data, corpus


def run_runner(data: Path, corpus: Path, url: str, limit: int, mode: str) -> Any:
    return subprocess.run(
        [sys.executable, str(RUNNER), str(data), str(corpus), url, str(limit), mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def writes_in_sync(tmp_path_factory: pytest.TempPathFactory, tei: LocalTEIServer) -> int:
    """How many Qdrant writes the v1 -> v2 sync makes when nothing kills it."""
    data, corpus = prepare_v1_then_v2(tmp_path_factory.mktemp("count"), tei.url)
    finished = run_runner(data, corpus, tei.url, 10**9, "after")
    assert finished.returncode == 0, finished.stderr[-2000:]
    count = int(finished.stdout.split("finished after ")[1].split()[0])
    # Two upserts (six changed documents, three a batch), a stale-chunk delete for each
    # of the three that shrank (none for those that grew) and one document delete.
    assert count >= 6
    return count


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_killed_ingest_then_rerun_equals_one_clean_run(
    seed: int,
    tmp_path: Path,
    tei: LocalTEIServer,
    reference: dict[str, Any],
    writes_in_sync: int,
) -> None:
    data, corpus = prepare_v1_then_v2(tmp_path, tei.url)
    rng = random.Random(seed)
    limit, mode = rng.randint(1, writes_in_sync), rng.choice(["before", "after"])
    killed = run_runner(data, corpus, tei.url, limit, mode)
    assert killed.returncode == 137, (limit, mode, killed.stdout, killed.stderr[-2000:])

    _crash_runner.run(data, corpus, tei.url)
    after = snapshot(data)
    assert after.keys() == reference.keys(), f"killed at write {limit} ({mode})"
    for point_id, (payload, vector) in reference.items():
        assert after[point_id] == (payload, vector), point_id
