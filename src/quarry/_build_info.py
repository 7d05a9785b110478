"""Which build of the chunker this install runs (``hatch_build.py`` compiles it when it can)."""

from __future__ import annotations

import importlib.util

__all__ = ["chunker_build", "compiled"]


def compiled(module: str) -> bool:
    """Whether ``module`` is a compiled extension here (found without importing it)."""
    spec = importlib.util.find_spec(module)
    return spec is not None and not str(spec.origin or "").endswith(".py")


def chunker_build() -> str:
    """``chunker compiled``, or what runs instead and why, for ``quarry --version``."""
    if compiled("quarry.chunking") and compiled("quarry._cpieces"):
        return "chunker compiled"
    return "chunker as plain Python: no C compiler or mypyc at install (see hatch_build.py)"
