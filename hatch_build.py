"""Build hook: compiles the chunker's hot path.

Two extensions, both optional by design:

- ``quarry._cpieces`` (C, ``src/quarry/_cpieces.c``): cl100k_base's pre-tokenizer
  and a table of per-piece token counts;
- ``quarry.chunking`` compiled by mypyc from ``src/quarry/chunking.py`` itself
  (the same source, type-checked strictly; no second implementation).

Where there is no C compiler or no mypyc (or ``QUARRY_BUILD_EXTENSION=0``), the
build says so and goes on: the same modules run as plain Python and give the same
chunks, about 2x slower. setuptools compiles both, so ``CC``, ``CFLAGS`` and the
platform's linker flags apply as for any extension.

An editable install (``make install-dev``) compiles them in place, next to their
sources, and imports them from there (the Makefile reinstalls when a source
changes; an editable build first removes what an earlier one left, so a fallback
never leaves a stale module in front of its source). A wheel is compiled in a
temporary folder and carries them with a platform tag; the checkout is not
written to.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = Path("src/quarry")
SOURCE = PACKAGE / "_cpieces.c"
CHUNKER = PACKAGE / "chunking.py"
BUILT_PATTERNS = ("_cpieces.*.so", "_cpieces.*.pyd", "chunking*.so", "chunking*.pyd")
FALLBACK = "it runs as plain Python (same chunks, slower)"


def say(message: str) -> None:
    """Tell whoever builds (pip shows it with -v, or when the build fails)."""
    print(f"quarry build: {message}", file=sys.stderr)


@contextlib.contextmanager
def _in(folder: Path) -> Iterator[None]:
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)


def _built(folder: Path, patterns: tuple[str, ...]) -> list[Path]:
    return sorted({path for pattern in patterns for path in folder.glob(pattern)})


def remove_built(root: Path) -> None:
    """Remove the extensions an earlier editable build left next to their sources."""
    for path in _built(root / PACKAGE, BUILT_PATTERNS):
        try:
            path.unlink()
        except OSError as exc:
            say(f"cannot remove {path} ({exc}): it may be imported in place of its source")


def _compile(
    name: str,
    extensions: Callable[[], list[Any]],
    patterns: tuple[str, ...],
    root: Path,
    out: Path | None,
    scratch: str,
) -> list[Path]:
    """Compile ``extensions()`` with setuptools, in place (``out`` None) or into
    ``out``/quarry/; the files built (matching ``patterns``), or [] after saying why."""
    folder = root / PACKAGE if out is None else out / "quarry"
    try:
        from setuptools import Distribution

        with _in(root):
            distribution = Distribution({"ext_modules": extensions(), "package_dir": {"": "src"}})
            command: Any = distribution.get_command_obj("build_ext")
            command.inplace = out is None
            command.build_temp = scratch
            command.build_lib = str(out) if out is not None else scratch
            distribution.run_command("build_ext")
    except (Exception, SystemExit) as exc:  # distutils and mypy report some errors by exiting
        say(f"building {name} failed ({exc}); {FALLBACK}")
        for path in _built(folder, patterns):
            path.unlink(missing_ok=True)
        return []
    return _built(folder, patterns)


def compile_extension(root: Path, out: Path | None, scratch: str) -> list[Path]:
    """Compile quarry._cpieces; the files built, or [] (after saying why)."""
    try:
        from setuptools import Extension
    except ImportError as exc:
        say(f"no setuptools ({exc}): quarry._cpieces not built; {FALLBACK}")
        return []
    return _compile(
        "quarry._cpieces",
        lambda: [Extension("quarry._cpieces", [str(SOURCE)])],
        BUILT_PATTERNS[:2],
        root,
        out,
        scratch,
    )


def compile_chunker(root: Path, out: Path | None, scratch: str) -> list[Path]:
    """Compile quarry.chunking with mypyc; the files built (the module and mypyc's
    runtime for it), or [] (after saying why)."""
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        say(f"no mypyc ({exc}): quarry.chunking not compiled; {FALLBACK}")
        return []

    def extensions() -> list[Any]:
        # No config file: the project's mypy settings name plugins (pydantic) that the
        # build environment does not have; chunking.py imports only the standard
        # library, tiktoken and quarry's own small modules. The cache stays in scratch.
        built: list[Any] = mypycify(
            [
                "--config-file=",
                "--ignore-missing-imports",
                f"--cache-dir={scratch}/mypy",
                str(CHUNKER),
            ],
            opt_level="3",
            target_dir=f"{scratch}/mypyc",
        )
        return built

    return _compile("quarry.chunking (mypyc)", extensions, BUILT_PATTERNS[2:], root, out, scratch)


class CustomBuildHook(BuildHookInterface):
    """Compiles quarry._cpieces and quarry.chunking for wheels and editable installs."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Build the extensions; a wheel that carries them is tagged for this platform."""
        self._out: Path | None = None
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        editable = version == "editable"
        if editable:
            remove_built(root)
        if os.environ.get("QUARRY_BUILD_EXTENSION", "1") == "0":
            say(f"QUARRY_BUILD_EXTENSION=0: nothing compiled; {FALLBACK}")
            return
        out = None if editable else Path(tempfile.mkdtemp(prefix="quarry-build-"))
        self._out = out
        with tempfile.TemporaryDirectory(prefix="quarry-build-") as scratch:
            built = compile_extension(root, out, scratch) + compile_chunker(root, out, scratch)
        if not built:
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if not editable:
            for path in built:
                build_data["force_include"][str(path)] = f"quarry/{path.name}"

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        """Remove the temporary folder a wheel's extensions were compiled in."""
        if getattr(self, "_out", None) is not None:
            shutil.rmtree(str(self._out), ignore_errors=True)
