"""Shared fixtures: isolated settings, real local_tei servers, a Prefect test harness."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to test a compiled module older than its source (hatch_build.py compiles
    them in place; `make install-dev` rebuilds them, plain pytest does not)."""
    package = Path(__file__).resolve().parent.parent / "src" / "quarry"
    for source, pattern in (("chunking.py", "chunking.*.so"), ("_cpieces.c", "_cpieces.*.so")):
        for built in package.glob(pattern):
            if built.stat().st_mtime < (package / source).stat().st_mtime:
                pytest.exit(
                    f"{built.name} is older than {source}: run `make install-dev` to compile "
                    "it again (or delete it to test the plain-Python module)",
                    returncode=4,
                )


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the developer's QUARRY_* settings; each gets its own data dir."""
    for key in list(os.environ):
        if key.startswith("QUARRY_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("QUARRY_DATA_DIR", str(tmp_path / "quarry-data"))


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One Prefect test server for the whole session (starting one is slow)."""
    from prefect.testing.utilities import prefect_test_harness

    from flows import EMBEDDED_STARTUP_TIMEOUT_S

    with prefect_test_harness(server_startup_timeout=EMBEDDED_STARTUP_TIMEOUT_S):
        yield


def write_corpus(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (relative path -> text) under ``root``; returns root."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def recording_deletes(path: Path) -> Any:
    """The real local-mode Qdrant client over ``path``, as quarry opens it, noting how
    each delete chooses its points (``.deletes``: "FilterSelector", "PointIdsList")."""
    from qdrant_client import QdrantClient

    from quarry.store import tune_local_storage

    class DeleteLog(QdrantClient):
        def __init__(self) -> None:
            super().__init__(path=str(path))
            self.deletes: list[str] = []

        def delete(self, collection_name: str, points_selector: Any, **kwargs: Any) -> Any:
            self.deletes.append(type(points_selector).__name__)
            return super().delete(collection_name, points_selector, **kwargs)

    client = DeleteLog()
    tune_local_storage(client)
    return client


def fail_listing(monkeypatch: pytest.MonkeyPatch, folder: str) -> None:
    """Make every folder named ``folder`` unlistable for quarry's loader (permission
    bits do not stop root, which the tests may run as)."""
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:
        if Path(path).name == folder:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr("quarry.sources.os.scandir", scandir)
