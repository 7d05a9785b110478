"""hatch_build.py: the chunker's C extension is optional, and says why when it is not built."""

from __future__ import annotations

import importlib.util
import shutil
import sysconfig
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
    package = tmp_path / "src" / "quarry"
    package.mkdir(parents=True)
    shutil.copy(ROOT / "src" / "quarry" / "_cpieces.c", package)
    return tmp_path


def test_the_extension_compiles_and_imports(tmp_path: Path) -> None:
    if shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        pytest.skip("no C compiler here")
    root = project_copy(tmp_path)
    built = load_hook().compile_extension(root)
    assert built is not None and built.parent == root / "src" / "quarry"
    spec = importlib.util.spec_from_file_location("quarry._cpieces", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.count) and callable(module.split)


def test_no_compiler_is_said_and_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = project_copy(tmp_path)
    hook = load_hook()
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        hook.sysconfig,
        "get_config_var",
        lambda name: "no-such-cc-here" if name == "CC" else real(name),
    )
    assert hook.compile_extension(root) is None
    assert "no C compiler (no-such-cc-here)" in capsys.readouterr().err
    assert list((root / "src" / "quarry").glob("*.so")) == []


def test_a_failed_compile_is_said_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        pytest.skip("no C compiler here")
    root = project_copy(tmp_path)
    (root / "src" / "quarry" / "_cpieces.c").write_text("this is not C\n")
    assert load_hook().compile_extension(root) is None
    captured = capsys.readouterr()
    assert "building quarry._cpieces failed" in captured.err
    assert "plain Python" in captured.err
    assert list((root / "src" / "quarry").glob("*.so")) == []
