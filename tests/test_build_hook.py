"""hatch_build.py: the chunker's extensions are optional, and the build says why when
one is not built; a wheel's build leaves the checkout alone."""

from __future__ import annotations

import importlib.util
import shutil
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_hook() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("quarry_hatch_build", ROOT / "hatch_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def project_copy(tmp_path: Path) -> Path:
    package = tmp_path / "project" / "src" / "quarry"
    package.mkdir(parents=True)
    shutil.copy(ROOT / "src" / "quarry" / "_cpieces.c", package)
    return tmp_path / "project"


def import_from(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("quarry._cpieces", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_extension_compiles_in_place_and_imports(tmp_path: Path) -> None:
    root = project_copy(tmp_path)
    built = load_hook().compile_extension(root, None, str(tmp_path / "scratch"))
    assert [path.parent for path in built] == [root / "src" / "quarry"]
    assert callable(import_from(built[0]).count)


def test_a_wheel_is_compiled_outside_the_checkout(tmp_path: Path) -> None:
    root = project_copy(tmp_path)
    out = tmp_path / "out"
    built = load_hook().compile_extension(root, out, str(tmp_path / "scratch"))
    assert [path.parent for path in built] == [out / "quarry"]
    assert sorted(p.name for p in (root / "src" / "quarry").iterdir()) == ["_cpieces.c"]


def test_no_compiler_is_said_and_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = project_copy(tmp_path)
    monkeypatch.setenv("CC", "no-such-cc-here")
    assert load_hook().compile_extension(root, None, str(tmp_path / "scratch")) == []
    said = capsys.readouterr().err
    assert "building quarry._cpieces failed" in said and "no-such-cc-here" in said
    assert "plain Python" in said
    assert list((root / "src" / "quarry").glob("*.so")) == []


def test_a_failed_compile_is_said_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = project_copy(tmp_path)
    (root / "src" / "quarry" / "_cpieces.c").write_text("this is not C\n")
    assert load_hook().compile_extension(root, None, str(tmp_path / "scratch")) == []
    assert "building quarry._cpieces failed" in capsys.readouterr().err
    assert list((root / "src" / "quarry").glob("*.so")) == []


def test_an_editable_build_first_removes_what_the_last_one_left(tmp_path: Path) -> None:
    # Else a build that falls back to plain Python would leave old compiled modules
    # in front of their sources.
    root = project_copy(tmp_path)
    package = root / "src" / "quarry"
    stale = [
        package / "_cpieces.cpython-311-x86_64-linux-gnu.so",
        package / "chunking.cpython-311-x86_64-linux-gnu.so",
        package / "chunking__mypyc.cpython-311-x86_64-linux-gnu.so",
    ]
    for path in stale:
        path.write_bytes(b"old")
    (package / "other.so").write_bytes(b"not ours")
    load_hook().remove_built(root)
    assert sorted(p.name for p in package.iterdir()) == ["_cpieces.c", "other.so"]
