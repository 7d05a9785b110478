"""The Qdrant store in local mode: storage tuning and collection naming."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from quarry.config import Settings
from quarry.fingerprint import Fingerprint, ModelIdentity, ServingIdentity
from quarry.store import VectorStore, open_client


def _fingerprint() -> Fingerprint:
    return Fingerprint(
        model=ModelIdentity("m", None, "mean", 4, True, "none"),
        serving=ServingIdentity("tei", "1.9.3", "float32", 32),
        canary=[0.5, 0.5, 0.5, 0.5],
        query_task="t",
    )


def test_local_collections_use_a_write_ahead_log(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, collection="wal")
    store = VectorStore(open_client(settings), "wal")
    physical = store.create(_fingerprint(), {"max_tokens": 8})
    store.close()
    files = list(settings.qdrant_path.rglob("storage.sqlite"))
    assert len(files) == 1 and physical in str(files[0])
    with sqlite3.connect(files[0]) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_two_rebuilds_in_one_second_get_distinct_names(tmp_path: Path) -> None:
    store = VectorStore(open_client(Settings(data_dir=tmp_path, collection="kb")), "kb")
    try:
        names = {store.create_physical(_fingerprint(), {}) for _ in range(3)}
        assert len(names) == 3
        assert all(name.startswith("kb__") for name in names)
    finally:
        store.close()
