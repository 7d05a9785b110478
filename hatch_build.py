"""Build hook: compiles the chunker's hot path.

Two extensions, both optional by design:

- ``quarry._cpieces`` (C, ``src/quarry/_cpieces.c``): cl100k_base's pre-tokenizer
  and a table of per-piece token counts;
- ``quarry.chunking`` compiled by mypyc from ``src/quarry/chunking.py`` itself
  (the same source, type-checked strictly; no second implementation).

Where there is no C compiler or no mypyc (or ``QUARRY_BUILD_EXTENSION=0``), the
build says so and goes on: the same modules run as plain Python and give the same
chunks, about 2x slower. Both are compiled in place, next to their sources: an
editable install (``make install-dev``) imports them from there (the Makefile
reinstalls when a source changes), and a wheel carries them with a platform tag.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("src/quarry/_cpieces.c")
CHUNKER = Path("src/quarry/chunking.py")
FALLBACK = "it runs as plain Python (same chunks, slower)"


def say(message: str) -> None:
    """Tell whoever builds (pip shows it with -v, or when the build fails)."""
    print(f"quarry build: {message}", file=sys.stderr)


def compile_extension(root: Path) -> Path | None:
    """Compile quarry._cpieces next to its source; None (after saying why) when it cannot be."""
    source = root / SOURCE
    target = source.with_name("_cpieces" + str(sysconfig.get_config_var("EXT_SUFFIX")))
    compiler = shlex.split(str(sysconfig.get_config_var("CC") or "cc"))
    if shutil.which(compiler[0]) is None:
        say(f"no C compiler ({compiler[0]}): quarry._cpieces not built; {FALLBACK}")
        return None
    command = [
        *compiler,
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
        "-o",
        str(target),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        say(
            f"building quarry._cpieces failed ({shlex.join(command)}):\n{result.stderr}\n{FALLBACK}"
        )
        target.unlink(missing_ok=True)
        return None
    return target


def compile_chunker(root: Path) -> list[Path]:
    """Compile quarry.chunking with mypyc, next to its source; [] (after saying why) when
    it cannot be. Returns the files built (the module and mypyc's runtime for it)."""
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as exc:
        say(f"no mypyc ({exc}): quarry.chunking not compiled; {FALLBACK}")
        return []
    package = root / CHUNKER.parent
    for stale in sorted(package.glob("chunking*.so")):  # the module and its chunking__mypyc runtime
        stale.unlink()
    cwd = os.getcwd()
    try:
        os.chdir(root)
        with tempfile.TemporaryDirectory() as scratch:
            # No config file: the project's mypy settings name plugins (pydantic) that the
            # build environment does not have; chunking.py imports only the standard
            # library, tiktoken and quarry's own small modules.
            extensions = mypycify(
                ["--config-file=", "--ignore-missing-imports", str(CHUNKER)],
                opt_level="3",
                target_dir=scratch,
            )
            distribution = Distribution({"ext_modules": extensions, "package_dir": {"": "src"}})
            command = distribution.get_command_obj("build_ext")
            command.inplace = True
            command.build_temp = scratch
            distribution.run_command("build_ext")
    except (Exception, SystemExit) as exc:  # mypy reports a type error by exiting
        say(f"compiling quarry.chunking with mypyc failed ({exc}); {FALLBACK}")
        for built in sorted(package.glob("chunking*.so")):
            built.unlink()
        return []
    finally:
        os.chdir(cwd)
    return sorted(package.glob("chunking*.so"))


class CustomBuildHook(BuildHookInterface):
    """Compiles quarry._cpieces and quarry.chunking for wheels and editable installs."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Build the extensions; a wheel that carries them is tagged for this platform."""
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        if os.environ.get("QUARRY_BUILD_EXTENSION", "1") == "0":
            for built in sorted((root / CHUNKER.parent).glob("*.so")):
                built.unlink()  # an editable install would import them still
            say(f"QUARRY_BUILD_EXTENSION=0: nothing compiled; {FALLBACK}")
            return
        extension = compile_extension(root)
        built = [extension] if extension is not None else []
        built += compile_chunker(root)
        if not built:
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            for path in built:
                build_data["force_include"][str(path)] = f"quarry/{path.name}"
