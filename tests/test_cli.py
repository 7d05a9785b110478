"""The command line as a user runs it: real processes, exit codes, --json on stdout."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows import EMBEDDED_STARTUP_TIMEOUT_S
from quarry.config import Settings
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from tests.conftest import write_corpus

QUARRY = [sys.executable, "-m", "quarry"]


@pytest.fixture(scope="module")
def tei() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16)) as server:
        yield server


@pytest.fixture(scope="module")
def prefect_api(prefect_harness: None) -> str:
    """The test harness's Prefect server, shared with the CLI subprocesses: each would
    otherwise start (and migrate) an ephemeral server of its own."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url
    return str(url)


def run(
    args: list[str], env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUARRY_")}
    full_env.update(env)
    return subprocess.run(
        QUARRY + args, capture_output=True, text=True, env=full_env, timeout=timeout, check=False
    )


def test_missing_path_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    result = run(["ingest", str(tmp_path / "nope")], {"QUARRY_DATA_DIR": str(tmp_path / "d")})
    assert result.returncode == 2
    assert "nope" in result.stderr


def test_dead_embedding_service_fails_fast_naming_the_url(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", {"a.md": "text"})
    started = time.monotonic()
    result = run(
        ["ingest", str(corpus)],
        {
            "QUARRY_DATA_DIR": str(tmp_path / "d"),
            "QUARRY_EMBED_URL": "http://127.0.0.1:9",
            "QUARRY_RETRY_BUDGET": "2",
        },
        timeout=120,
    )
    assert result.returncode == 1
    assert "http://127.0.0.1:9" in result.stderr
    # The wait is announced as it starts, not only when the budget is spent.
    assert "retrying for up to 2s (QUARRY_RETRY_BUDGET)" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["chunk", "{file}", "--max-tokens", "16", "--overlap", "100"], {}, "--overlap"),
        (["chunk", "{file}"], {"QUARRY_CHUNK_TOKENS": "abc"}, "QUARRY_CHUNK_TOKENS:"),
        (["status"], {"QUARRY_EMBED_URL": "not a url"}, "QUARRY_EMBED_URL: 'not a url' is not"),
        # Review: a bad port reached the Qdrant client, exit 1 and the variable unnamed.
        (["status"], {"QUARRY_QDRANT_URL": "http://127.0.0.1:99999"}, "QUARRY_QDRANT_URL: "),
        (["status"], {"QUARRY_EMBED_URL": "http://[::1"}, "QUARRY_EMBED_URL: "),
        # Review trial: nan put every rerank score under it; every answer came back empty.
        (["status"], {"QUARRY_RERANK_THRESHOLD": "nan"}, "QUARRY_RERANK_THRESHOLD:"),
        (["chunk", "{dir}"], {}, "is a directory"),
        (["query", "  "], {}, "the query is empty"),
        (["query", "\u200d"], {}, "the query is empty"),  # as the API's 422 says
        (["query", "\U000e0067\x7f"], {}, "the query is empty"),
        (["parity", "--candidate-embed-url", "notaurl"], {}, "--candidate-embed-url: 'notaurl'"),
        (["api", "--port", "70000"], {}, "--port"),
        (["local-tei", "--backend", "hash", "--port", "99999"], {}, "port must be in 0..65535"),
        (["local-tei", "--backend", "hash", "--dims", "0"], {}, "quarry local-tei: error:"),
        (["ingest", "{same1}", "{same2}"], {}, "two sources are named 'same'"),
    ],
)
def test_bad_settings_and_arguments_are_usage_errors_that_say_what_to_fix(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    doc = write_corpus(tmp_path / "c", {"a.md": "# A\n\nText."})
    same1 = write_corpus(tmp_path / "x1" / "same", {"one.md": "# One"})
    same2 = write_corpus(tmp_path / "x2" / "same", {"two.md": "# Two"})
    args = [a.format(file=doc / "a.md", dir=doc, same1=same1, same2=same2) for a in args]
    result = run(args, {"QUARRY_DATA_DIR": str(tmp_path / "d"), **env}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "pydantic" not in result.stderr
    assert "Traceback" not in result.stderr


def test_chunk_reads_a_legacy_file_in_the_encoding_given_and_says_so(tmp_path: Path) -> None:
    text = "В городе работают сотни университетов, музеев и театров."
    (tmp_path / "ru.txt").write_bytes(text.encode("cp1251"))
    given = run(["chunk", str(tmp_path / "ru.txt"), "--encoding", "CP1251", "--json"], {})
    assert given.returncode == 0, given.stderr
    answer = json.loads(given.stdout)
    assert ([c["text"] for c in answer["chunks"]], answer["encoding"]) == ([text], "cp1251")
    human = run(["chunk", str(tmp_path / "ru.txt"), "--encoding", "cp1251"], {})
    assert "ru.txt: read as cp1251" in human.stderr
    unknown = run(["chunk", str(tmp_path / "ru.txt"), "--encoding", "klingon"], {})
    assert unknown.returncode == 2
    assert "unknown encoding 'klingon'" in unknown.stderr


def test_chunk_json_shape(tmp_path: Path) -> None:
    doc = write_corpus(tmp_path, {"g.md": "# Title\n\n" + "Some words here. " * 200})
    result = run(["chunk", str(doc / "g.md"), "--max-tokens", "64", "--overlap", "8", "--json"], {})
    assert result.returncode == 0, result.stderr
    chunks = json.loads(result.stdout)["chunks"]
    assert json.loads(result.stdout)["encoding"] == "utf-8"
    assert len(chunks) > 1
    assert set(chunks[0]) == {
        "uri",
        "page",
        "index",
        "text",
        "token_count",
        "headings",
        "char_start",
        "char_end",
    }
    assert all(c["token_count"] <= 64 for c in chunks)
    assert chunks[0]["headings"] == ["Title"]
    assert (chunks[0]["uri"], chunks[0]["page"]) == (f"{tmp_path.name}/g.md", None)


def _peak_rss_of_chunk(path: Path) -> tuple[int, str]:
    """The peak resident memory (bytes) of ``quarry chunk PATH --json``, and its stdout."""
    measure = (
        "import resource, subprocess, sys; "
        "out = subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True).stdout; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.stdout.write(out)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUARRY_")}
    result = subprocess.run(
        [sys.executable, "-c", measure, *QUARRY, "chunk", str(path), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    peak, _, stdout = result.stdout.partition("\n")
    return int(peak) * 1024, stdout  # ru_maxrss is in kB on Linux


def test_chunk_json_of_a_big_file_is_written_as_made_not_held_whole(tmp_path: Path) -> None:
    # The whole list of chunks and then its JSON text held 13 times the file at once.
    paragraph = "Granite was cut here in terraces until the pumps stopped. " * 6
    big = tmp_path / "big.md"
    big.write_text("# Quarry\n\n" + "\n\n".join(f"{i}. {paragraph}" for i in range(24_000)))
    (tmp_path / "small.md").write_text("# Quarry\n\nOne short paragraph.\n")
    baseline, _ = _peak_rss_of_chunk(tmp_path / "small.md")
    peak, stdout = _peak_rss_of_chunk(big)
    size = big.stat().st_size
    assert size > 8_000_000
    assert peak - baseline < 6 * size, f"{(peak - baseline) / size:.1f}x the file"
    answer = json.loads(stdout)  # whole and valid, laid out as json.dumps lays it out
    assert stdout == json.dumps(answer, indent=2, ensure_ascii=False) + "\n"
    assert answer["encoding"] == "utf-8" and answer["chunks"][-1]["char_end"] == len(
        big.read_text()
    )


def test_chunk_json_keeps_cjk_readable_where_stdout_takes_utf8(tmp_path: Path) -> None:
    (tmp_path / "ja.txt").write_text("検索システムは文書を分割します。" * 40, encoding="utf-8")
    args = ["chunk", str(tmp_path / "ja.txt"), "--max-tokens", "64", "--json"]
    readable = run(args, {"PYTHONIOENCODING": "utf-8"})
    assert readable.returncode == 0, readable.stderr
    assert "検索システム" in readable.stdout
    # A stdout that cannot take it still gets valid JSON, escaped.
    escaped = run(args, {"PYTHONIOENCODING": "ascii"})
    assert escaped.returncode == 0, escaped.stderr
    assert escaped.stdout.isascii()
    assert json.loads(escaped.stdout) == json.loads(readable.stdout)


def test_chunk_of_a_file_without_text_says_so(tmp_path: Path) -> None:
    (tmp_path / "blank.md").write_text("  \n\n\t\n")
    result = run(["chunk", str(tmp_path / "blank.md")], {})
    assert result.returncode == 0, result.stderr
    assert "no text, so no chunks" in result.stdout


def test_chunk_of_an_unreadable_file_names_it_as_given(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "blob.txt").write_bytes(b"text\x00\x01\x02 more")
    result = run(["chunk", str(tmp_path / "sub" / "blob.txt"), "--json"], {})
    assert result.returncode == 1, result.stderr
    error = json.loads(result.stdout)["error"]
    # Not "sub/blob.txt: ..., skipped": the command failed, on the path it was given.
    assert error["message"] == f"{tmp_path / 'sub' / 'blob.txt'}: binary file (NUL bytes)"
    (tmp_path / "big.txt").write_text("x" * 200)
    result = run(["chunk", str(tmp_path / "big.txt"), "--json"], {"QUARRY_MAX_FILE_BYTES": "100"})
    message = json.loads(result.stdout)["error"]["message"]
    assert message.startswith(f"{tmp_path / 'big.txt'}: file is 200 bytes, over the 100-byte")
    assert "skipped" not in message


def test_chunk_names_the_page_of_each_pdf_chunk(tmp_path: Path) -> None:
    from tests.test_sources import make_pdf

    (tmp_path / "two.pdf").write_bytes(make_pdf(["First page text.", "Second page text."]))
    result = run(["chunk", str(tmp_path / "two.pdf"), "--json"], {})
    assert result.returncode == 0, result.stderr
    chunks = json.loads(result.stdout)["chunks"]
    assert [(c["page"], c["index"]) for c in chunks] == [(1, 0), (2, 0)]
    assert chunks[1]["uri"].endswith("two.pdf#page=2")
    assert "Second page" in chunks[1]["text"]


def ingest_env(tmp_path: Path, url: str, prefect_api: str) -> dict[str, str]:
    """The environment of CLI calls on a data folder of their own under ``tmp_path``,
    embedding with the service at ``url``, on the test harness's Prefect server."""
    data = str(tmp_path / "d")
    return {"QUARRY_DATA_DIR": data, "QUARRY_EMBED_URL": url, "PREFECT_API_URL": prefect_api}


def test_ingest_query_status_round_trip(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    env = ingest_env(tmp_path, tei.url, prefect_api)
    corpus = write_corpus(
        tmp_path / "kb",
        {
            "cats.md": "# Cats\n\nCats purr and sleep in the sun all day.",
            "rockets.md": "# Rockets\n\nRockets burn fuel to reach orbit around the earth.",
        },
    )
    ingested = run(["ingest", str(corpus), "--json"], env)
    assert ingested.returncode == 0, ingested.stderr
    summary = json.loads(ingested.stdout)
    assert summary["documents_embedded"] == 2
    assert "Traceback" not in ingested.stderr and "ERROR" not in ingested.stderr

    answered = run(["query", "Rockets burn fuel to reach orbit", "--json", "-k", "1"], env)
    assert answered.returncode == 0, answered.stderr
    response = json.loads(answered.stdout)
    assert response["results"][0]["uri"] == "kb/rockets.md"
    assert set(response["results"][0]) >= {
        "text",
        "score",
        "vector_score",
        "rerank_score",
        "uri",
        "doc_id",
        "chunk_index",
        "headings",
    }

    shown = run(["status", "--json"], env)
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["alias"] == "quarry"
    assert status["documents"] == 2 and status["documents_incomplete"] == 0
    assert status["fingerprint"]["model"]["dimensions"] == 16
    assert json.loads(run(["--json", "status"], env).stdout) == status  # the flag first
    # The physical collection named directly reads the same (a candidate, a rollback target).
    by_name = run(["status", "--json", "--collection", status["collection"]], env)
    assert by_name.returncode == 0, by_name.stderr
    assert json.loads(by_name.stdout) == status


def test_ingest_fail_on_failures_exits_4_with_the_summary_on_stdout(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    env = ingest_env(tmp_path, tei.url, prefect_api)
    corpus = write_corpus(tmp_path / "kb", {"good.md": "# Good\n\nIndexed all the same."})
    (corpus / "bad.md").write_bytes(b"a\x00b")
    strict = run(["ingest", str(corpus), "--fail-on-failures", "--json"], env)
    assert strict.returncode == 4, strict.stderr
    summary = json.loads(strict.stdout)  # the run's summary, not an error object
    assert (summary["documents_embedded"], summary["documents_failed"]) == (1, 1)
    assert "1 documents could not be indexed (fail on failures); first: kb/bad.md" in strict.stderr
    assert "Traceback" not in strict.stderr
    lenient = run(["ingest", str(corpus)], env)
    assert lenient.returncode == 0, lenient.stderr
    assert "0 embedded (0 new, 0 changed;" in lenient.stdout
    assert "failed: kb/bad.md" in lenient.stdout


def ingested(tmp_path: Path, url: str, prefect_api: str, files: dict[str, str]) -> dict[str, str]:
    """Index ``files`` (folder kb) with the service at ``url``; the environment used."""
    corpus = write_corpus(tmp_path / "kb", files)
    env = ingest_env(tmp_path, url, prefect_api)
    done = run(["ingest", str(corpus)], env)
    assert done.returncode == 0, done.stderr
    return env


def test_query_refuses_a_different_model(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    env = ingested(tmp_path, tei.url, prefect_api, {"a.md": "alpha beta gamma"})
    data, corpus = env["QUARRY_DATA_DIR"], tmp_path / "kb"
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, seed=3)) as other:
        refused = run(["query", "alpha"], {"QUARRY_DATA_DIR": data, "QUARRY_EMBED_URL": other.url})
        ingest = run(["ingest", str(corpus)], {**env, "QUARRY_EMBED_URL": other.url})
    assert refused.returncode == 3
    assert "quarry reindex" in refused.stderr
    # The flow fails with the refusal: one clear line, no traceback from Prefect's log.
    assert ingest.returncode == 3, ingest.stderr
    assert "quarry reindex" in ingest.stderr
    assert "Traceback" not in ingest.stderr, ingest.stderr


def test_rollback_names_the_model_the_collection_it_returns_to_needs(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    corpus = write_corpus(tmp_path / "c", {"a.md": "Alpha text. " * 20})
    env = {"QUARRY_DATA_DIR": str(tmp_path / "d"), "PREFECT_API_URL": prefect_api}
    assert run(["ingest", str(corpus)], {**env, "QUARRY_EMBED_URL": tei.url}).returncode == 0
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=8)) as other:
        other_model = {**env, "QUARRY_EMBED_URL": other.url}
        assert run(["reindex"], other_model).returncode == 0
        back = run(["rollback", "--json"], env)
        assert back.returncode == 0, back.stderr
        model = json.loads(back.stdout)["model"]
        assert model["model_id"].startswith("quarry/hash-embedding-16d"), model
        assert run(["reindex"], other_model).returncode == 0
        listed = run(["collections"], env).stdout  # where a rollback would go, in words
        [marked] = [line for line in listed.splitlines() if "rollback returns here" in line]
        assert not marked.startswith("*") and "hash-embedding-16d" in marked, listed
    said = run(["rollback"], env)  # in words too
    assert "built by quarry/hash-embedding-16d" in said.stdout, said.stdout
    assert "serve that model" in said.stdout
    # And forth again: the collection the rollback left is one --to away.
    left = said.stdout.splitlines()[0].split(": ", 1)[1].split(" -> ")[0]
    forth = run(["rollback", "--to", left, "--json"], env)
    assert forth.returncode == 0, forth.stderr
    assert json.loads(forth.stdout)["model"]["model_id"].startswith("quarry/hash-embedding-8d")
    again = run(["rollback", "--to", left], env)  # where it already is: says nothing moved
    assert again.returncode == 0, again.stderr
    assert f"already serves {left}; nothing changed" in again.stdout


def test_a_query_too_long_for_the_model_is_a_usage_error(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    env = ingested(tmp_path, tei.url, prefect_api, {"a.md": "alpha beta gamma"})
    answered = run(["query", "long " * 2000], env)
    assert answered.returncode == 2, answered.stderr
    assert "the query is too long for the model" in answered.stderr
    assert "Traceback" not in answered.stderr


def test_a_query_too_long_for_the_reranker_alone_is_a_usage_error_not_a_fallback(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    # As the API's 422: an optional reranker does not hide the question's fault.
    env = ingested(tmp_path, tei.url, prefect_api, {"a.md": "alpha beta gamma"})
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, max_input_length=24)) as short:
        answered = run(["query", "alpha " * 40], {**env, "QUARRY_RERANK_URL": short.url})
        without = run(
            ["query", "alpha " * 40, "--no-rerank"], {**env, "QUARRY_RERANK_URL": short.url}
        )
    assert answered.returncode == 2, answered.stderr
    assert "over the reranker's input limit" in answered.stderr
    assert "Traceback" not in answered.stderr
    assert without.returncode == 0, without.stderr


def test_a_dead_optional_reranker_is_waited_on_for_a_restart_not_the_whole_budget(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    # API trial: `quarry query` waited out QUARRY_RETRY_BUDGET (30 s) on a reranker
    # nothing listened for, then answered from vector scores; the API waits 2 s.
    env = ingested(tmp_path, tei.url, prefect_api, {"a.md": "alpha beta gamma"})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    answered = run(["query", "alpha", "--json"], {**env, "QUARRY_RERANK_URL": dead})
    assert answered.returncode == 0, answered.stderr
    [warning] = json.loads(answered.stdout)["warnings"]
    assert warning.startswith("rerank failed") and "(retry budget 5s)" in warning
    assert "cap for a reranker not required" in answered.stderr
    required = run(
        ["query", "alpha", "--json"],
        {
            **env,
            "QUARRY_RERANK_URL": dead,
            "QUARRY_RERANK_REQUIRED": "1",
            "QUARRY_RETRY_BUDGET": "2",
        },
    )
    assert required.returncode == 1 and "(retry budget 2s)" in required.stdout


def test_a_passage_too_long_for_a_required_reranker_is_not_blamed_on_the_query(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    env = ingested(tmp_path, tei.url, prefect_api, {"a.md": "alpha beta gamma delta. " * 60})
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16, max_input_length=24)) as short:
        answered = run(
            ["query", "alpha beta"],
            {**env, "QUARRY_RERANK_URL": short.url, "QUARRY_RERANK_REQUIRED": "1"},
        )
    assert answered.returncode == 1, answered.stderr
    assert "the query is too long" not in answered.stderr


def test_parity_gives_key_protected_candidates_the_services_key(
    tmp_path: Path, prefect_api: str
) -> None:
    # compose.yaml gates every TEI with --api-key, the engine being tried included.
    config = LocalTEIConfig(backend="hash", dims=16, api_key="k3y")
    with LocalTEIServer(config) as live, LocalTEIServer(config) as candidate:
        env = {
            "QUARRY_DATA_DIR": str(tmp_path / "d"),
            "QUARRY_EMBED_URL": live.url,
            "QUARRY_EMBED_API_KEY": "k3y",
            "PREFECT_API_URL": prefect_api,
        }
        corpus = write_corpus(tmp_path / "kb", {"a.md": "alpha beta", "b.md": "gamma delta"})
        assert run(["ingest", str(corpus)], env).returncode == 0
        result = run(
            [
                "parity",
                "--candidate-embed-url",
                candidate.url,
                "--candidate-rerank-url",
                candidate.url,
                "--sample",
                "2",
                "--json",
            ],
            env,
        )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True
    assert report["rerank"]["top1_agreement"] == 1.0


def test_status_shows_a_serving_stack_that_parity_accepted(
    tmp_path: Path, prefect_api: str
) -> None:
    # Operator trial: after `parity --accept` queries served by the new engine worked,
    # but nothing showed that it was accepted, or when.
    live_config = LocalTEIConfig(backend="hash", dims=16)
    candidate_config = LocalTEIConfig(backend="hash", dims=16, engine_version="1.9.4")
    with LocalTEIServer(live_config) as live, LocalTEIServer(candidate_config) as candidate:
        env = {
            "QUARRY_DATA_DIR": str(tmp_path / "d"),
            "QUARRY_EMBED_URL": live.url,
            "PREFECT_API_URL": prefect_api,
        }
        corpus = write_corpus(tmp_path / "kb", {"a.md": "alpha beta", "b.md": "gamma delta"})
        assert run(["ingest", str(corpus)], env).returncode == 0
        before = json.loads(run(["status", "--json"], env).stdout)
        assert before["accepted_serving"] == []
        args = ["parity", "--candidate-embed-url", candidate.url, "--sample", "2", "--accept"]
        assert run(args, env).returncode == 0
        after = json.loads(run(["status", "--json"], env).stdout)
        text = run(["status"], env).stdout
    [accepted] = after["accepted_serving"]
    assert accepted["engine_version"] == "1.9.4" and accepted["accepted_at"]
    assert after["fingerprint"]["serving"]["engine_version"] == "1.9.3"
    assert "accepted     tei 1.9.4" in text and "(quarry parity --accept, measured 20" in text


def test_a_refusal_with_json_is_a_json_error_on_stdout(tmp_path: Path) -> None:
    result = run(["ingest", str(tmp_path / "nowhere" / "a.md"), "--json"], {}, timeout=120)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout)["error"]
    assert (error["type"], error["exit_code"]) == ("usage", 2)
    assert "nowhere" in error["message"] and error["message"] in result.stderr


def test_an_option_parser_error_with_json_is_a_json_usage_error_on_stdout(
    tmp_path: Path,
) -> None:
    env = {"QUARRY_DATA_DIR": str(tmp_path / "d")}
    cases = {
        ("ingest", "--json", "--no-such-flag"): "--no-such-flag",
        ("query", "--json"): "Missing argument",
        ("chunk", str(tmp_path / "a.md"), "--json", "--max-tokens", "many"): "--max-tokens",
        # Before the command, --json is the command's: the error names the bad flag.
        ("--json", "status", "--bogus"): "--bogus",
    }
    for args, said in cases.items():
        result = run(list(args), env, timeout=120)
        assert result.returncode == 2, (args, result.stderr)
        error = json.loads(result.stdout)["error"]
        assert (error["type"], error["exit_code"]) == ("usage", 2), args
        assert said in error["message"] and error["message"] in result.stderr, args
    # Without --json the parser's own report stays on stderr, stdout empty.
    result = run(["ingest", "--no-such-flag"], env, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert "--no-such-flag" in result.stderr


def test_an_ingest_meets_local_qdrant_held_by_another_process_before_prefect_starts(
    tmp_path: Path,
) -> None:
    from filelock import FileLock
    from qdrant_client import QdrantClient

    from quarry.cli import _preflight
    from quarry.errors import StoreLocked
    from quarry.store import writer_lock_path

    settings = Settings(data_dir=tmp_path / "d")
    held = QdrantClient(path=str(settings.qdrant_path))  # as `quarry api` holds it
    try:
        # The whole folder is held: no collection is named (an eval uses another).
        with pytest.raises(StoreLocked, match=r"^local-mode Qdrant at .* in use by another"):
            _preflight(settings)
        writer_lock_path(settings).parent.mkdir(parents=True)
        # Held by another ingest (the writers' lock too): that one is waited for later.
        with FileLock(str(writer_lock_path(settings))):
            _preflight(settings)
    finally:
        held.close()
    _preflight(settings)  # free again


def test_reindex_checks_its_eval_dataset_before_building_anything(tmp_path: Path) -> None:
    not_beir = write_corpus(tmp_path / "notes", {"a.md": "text"})
    result = run(
        ["reindex", "--eval", str(not_beir), "--min-ndcg", "0.1", "--json"],
        {"QUARRY_DATA_DIR": str(tmp_path / "d")},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout)["error"]
    assert "corpus.jsonl: missing from the BEIR dataset" in error["message"]


@pytest.mark.parametrize("threshold", ["nan", "1.5", "-0.1"])
def test_reindex_refuses_a_min_ndcg_outside_0_to_1_before_building(
    tmp_path: Path, threshold: str
) -> None:
    # nan passed every gate (nothing compares below it); 1.5 refused every build, but
    # only after the whole collection had been re-embedded.
    result = run(
        ["reindex", "--eval", str(tmp_path), "--min-ndcg", threshold, "--json"],
        {"QUARRY_DATA_DIR": str(tmp_path / "d")},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--min-ndcg must be between 0 and 1" in json.loads(result.stdout)["error"]["message"]


def test_reindex_refuses_an_eval_split_without_eval(tmp_path: Path) -> None:
    # Operator trial: --eval-split alone was ignored, and the reindex switched unevaluated.
    result = run(
        ["reindex", "--eval-split", "dev", "--force", "--json"],
        {"QUARRY_DATA_DIR": str(tmp_path / "d")},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert json.loads(result.stdout)["error"]["message"] == "--eval-split needs --eval DATASET"


def test_reindex_checks_the_eval_split_it_is_given(tmp_path: Path) -> None:
    beir = Path(__file__).parent / "data" / "beir_tiny"
    result = run(
        ["reindex", "--eval", str(beir), "--eval-split", "nosuch", "--json"],
        {"QUARRY_DATA_DIR": str(tmp_path / "d")},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "(splits here: dev, test)" in json.loads(result.stdout)["error"]["message"]


def test_an_unreachable_qdrant_server_is_one_line_naming_the_setting(
    tmp_path: Path, tei: LocalTEIServer
) -> None:
    corpus = write_corpus(tmp_path / "c", {"a.md": "text"})
    env = {
        "QUARRY_DATA_DIR": str(tmp_path / "d"),
        "QUARRY_EMBED_URL": tei.url,
        "QUARRY_QDRANT_URL": "http://127.0.0.1:9",
    }
    for args in (["status", "--json"], ["ingest", str(corpus), "--json"]):
        result = run(args, env, timeout=120)
        assert result.returncode == 1, (args, result.stderr)
        said = "Qdrant at http://127.0.0.1:9 (QUARRY_QDRANT_URL) does not answer"
        assert said in result.stderr
        assert "Traceback" not in result.stderr
        # With --json a script reading stdout learns why too.
        error = json.loads(result.stdout)["error"]
        assert (error["type"], error["exit_code"]) == ("failed", 1) and said in error["message"]


@pytest.mark.parametrize("command", ["prune", "rollback"])
def test_prune_and_rollback_refuse_while_a_writer_holds_local_qdrant(
    tmp_path: Path, command: str
) -> None:
    from filelock import FileLock

    from quarry.store import writer_lock_path

    settings = Settings(data_dir=tmp_path / "d")
    writer_lock_path(settings).parent.mkdir(parents=True)
    env = {"QUARRY_DATA_DIR": str(settings.data_dir)}
    with FileLock(str(writer_lock_path(settings))):  # as a reindex holds it
        result = run([command, "--json"], env, timeout=120)
    assert result.returncode == 1, result.stderr
    said = f"an ingest or reindex is writing to local-mode Qdrant in {settings.data_dir}"
    assert said in json.loads(result.stdout)["error"]["message"]
    assert "Traceback" not in result.stderr


def test_prune_refuses_while_a_reindex_holds_the_collections_prefect_slot(
    tmp_path: Path, prefect_api: str
) -> None:
    # With a Qdrant server the build a reindex is writing looks unfinished to prune,
    # which drops unfinished builds first: prune must wait for the writers' slot.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency

    name = "quarry-ingest-slotted"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    env = {
        "QUARRY_DATA_DIR": str(tmp_path / "d"),
        "QUARRY_COLLECTION": "slotted",
        "QUARRY_QDRANT_URL": "http://127.0.0.1:9",
        "PREFECT_API_URL": prefect_api,
    }
    with concurrency(name, occupy=1):  # as a running reindex holds it
        held = run(["prune", "--json"], env, timeout=120)
    assert held.returncode == 1, held.stderr
    message = json.loads(held.stdout)["error"]["message"]
    assert "an ingest or reindex of 'slotted' is running" in message and name in message
    assert "Traceback" not in held.stderr and "ConcurrencySlotAcquisition" not in held.stderr
    # Free again: prune goes on to Qdrant (not running here).
    free = run(["prune", "--json"], env, timeout=120)
    assert free.returncode == 1
    assert "Qdrant at http://127.0.0.1:9" in json.loads(free.stdout)["error"]["message"]


def test_prune_with_the_prefect_api_down_says_so_not_that_a_writer_runs(tmp_path: Path) -> None:
    env = {
        "QUARRY_DATA_DIR": str(tmp_path / "d"),
        "QUARRY_COLLECTION": "slotted",
        "QUARRY_QDRANT_URL": "http://127.0.0.1:9",
        "PREFECT_API_URL": "http://127.0.0.1:9/api",  # nothing listens there
    }
    result = run(["prune", "--json"], env, timeout=120)
    assert result.returncode == 1, result.stderr
    message = json.loads(result.stdout)["error"]["message"]
    assert "is running" not in message
    assert "http://127.0.0.1:9/api" in message and "quarry-ingest-slotted" in message


def test_prune_without_a_prefect_server_uses_the_writers_embedded_prefect(
    tmp_path: Path,
) -> None:
    # Operator trial: prune and rollback started their Prefect in ~/.prefect, where no
    # writer's concurrency limit is, instead of the data dir's, as ingest and reindex.
    home, data = tmp_path / "home", tmp_path / "d"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUARRY_", "PREFECT_"))}
    env.update({"HOME": str(home), "QUARRY_DATA_DIR": str(data)})
    env["QUARRY_QDRANT_URL"] = "http://127.0.0.1:9"  # nothing listens: prune fails there
    result = subprocess.run(
        [*QUARRY, "prune", "--json"], capture_output=True, text=True, env=env, timeout=180
    )
    assert result.returncode == 1, result.stderr
    assert "Qdrant at http://127.0.0.1:9" in json.loads(result.stdout)["error"]["message"]
    assert (data / "prefect").is_dir()
    assert not (home / ".prefect").exists()
    assert "Traceback" not in result.stderr


def test_a_data_dir_that_cannot_be_a_folder_is_a_usage_error_naming_it(
    tmp_path: Path, tei: LocalTEIServer
) -> None:
    corpus = write_corpus(tmp_path / "c", {"a.md": "text"})
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("x")
    env = {"QUARRY_DATA_DIR": str(not_a_folder), "QUARRY_EMBED_URL": tei.url}
    for args in (["status"], ["ingest", str(corpus)]):
        result = run(args, env, timeout=120)
        assert result.returncode == 2, (args, result.stderr)
        assert f"QUARRY_DATA_DIR={not_a_folder}: cannot create" in result.stderr
        assert "Traceback" not in result.stderr


def test_local_tei_takes_every_option_of_the_module_and_says_when_its_port_is_taken(
    tei: LocalTEIServer,
) -> None:
    helped = run(["local-tei", "--help"], {}, timeout=60)
    assert helped.returncode == 0
    for option in ("--auto-truncate", "--payload-limit", "--engine-version", "--rerank-dialect"):
        assert option in helped.stdout
    # The defaults a user needs, quarry's own port among them (the module picks a free one).
    flat = " ".join(helped.stdout.split())
    for default in ("(default: minilm)", "(default: 8001)", "(default: 32768)"):
        assert default in flat
    port = tei.url.rsplit(":", 1)[1]
    taken = run(["local-tei", "--backend", "hash", "--port", port], {}, timeout=60)
    assert taken.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    assert "Traceback" not in taken.stderr


def test_chunk_names_what_is_wrong_with_a_path_that_is_not_a_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.md")
    (tmp_path / "loop.md").symlink_to("loop.md")
    fifo = run(["chunk", str(tmp_path / "fifo.md")], {}, timeout=60)  # must not wait on it
    assert fifo.returncode == 1 and "not a regular file" in fifo.stderr
    loop = run(["chunk", str(tmp_path / "loop.md")], {}, timeout=60)
    assert loop.returncode == 1 and "symlink loop" in loop.stderr


def test_a_source_with_no_file_to_index_says_so(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    (tmp_path / "empty").mkdir()
    env = ingest_env(tmp_path, tei.url, prefect_api)
    result = run(["ingest", str(tmp_path / "empty"), "--json"], env)
    assert result.returncode == 0, result.stderr
    notes = json.loads(result.stdout)["notes"]
    assert any("empty: no file to index" in note for note in notes), notes


# 160 documents: three batches (Prefect tasks) of at most 64, so one is done while
# the others are still being embedded; and a service that embeds them slowly (one
# request of 4 inputs at a time, 0.15 s each), the model of the module's ``tei``.
MANY_FILES = {
    f"doc{i:03d}.md": f"# Doc {i}\n\n" + f"Sentence {i} on a topic. " * 40 for i in range(160)
}
SLOW_TEI = LocalTEIConfig(backend="hash", dims=16, latency_ms=150.0, max_concurrent_requests=4)


def ctrl_c_when(
    args: list[str],
    env: dict[str, str],
    marker: str,
    log: Path,
    *,
    sig: int = signal.SIGINT,
    whole_group: bool = True,
) -> str:
    """Run quarry in embedded Prefect mode as a terminal does, send the whole process
    group (or quarry alone) ``sig`` once ``marker`` shows on stderr, and return stderr
    (stdout goes to ``log`` with the suffix ``.out``); asserts exit 128 + ``sig`` (for
    SIGKILL: killed) and that no process of the group is left."""
    embedded = {k: v for k, v in os.environ.items() if not k.startswith(("QUARRY_", "PREFECT_"))}
    with log.open("w") as stderr:
        # A session of its own: the terminal's Ctrl-C reaches the whole process
        # group, Prefect's temporary server included.
        process = subprocess.Popen(
            [*QUARRY, *args],
            env={**embedded, **env},
            stdout=log.with_suffix(".out").open("w"),
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while marker not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"{marker!r} never showed"
            time.sleep(0.2)
        if whole_group:
            os.killpg(process.pid, sig)
        else:
            os.kill(process.pid, sig)
        killed = -sig if sig == signal.SIGKILL else 128 + sig
        assert process.wait(timeout=60) == killed, log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    for _ in range(150):  # nothing of the group is left (Prefect's server is stopped)
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"a process of the interrupted `quarry {args[0]}` is still running")
    return log.read_text()


def test_ctrl_c_stops_an_embedded_ingest_at_once_and_a_rerun_completes_it(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    corpus = write_corpus(tmp_path / "kb", MANY_FILES)
    data = str(tmp_path / "d")
    with LocalTEIServer(SLOW_TEI) as slow:
        env = {"QUARRY_DATA_DIR": data, "QUARRY_EMBED_URL": slow.url}
        said = ctrl_c_when(
            ["ingest", str(corpus)], env, "Finished in state Completed", tmp_path / "err"
        )
    assert "quarry: error: interrupted: a rerun picks up where this one stopped" in said
    assert "Traceback" not in said

    served = {"QUARRY_EMBED_URL": tei.url, "PREFECT_API_URL": prefect_api}
    rerun = run(["ingest", str(corpus), "--json"], {**served, "QUARRY_DATA_DIR": data})
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["documents_failed"] == 0
    assert 0 < summary["documents_skipped"] < 160  # what was written before Ctrl-C is kept
    clean = run(["ingest", str(corpus)], {**served, "QUARRY_DATA_DIR": str(tmp_path / "clean")})
    assert clean.returncode == 0, clean.stderr
    resumed, whole = (
        json.loads(run(["status", "--json"], {**served, "QUARRY_DATA_DIR": d}).stdout)
        for d in (data, str(tmp_path / "clean"))
    )
    assert (resumed["documents"], resumed["points"]) == (whole["documents"], whole["points"])


@pytest.mark.parametrize("whole_group", [False, True], ids=["quarry-alone", "whole-group"])
def test_sigterm_to_an_embedded_ingest_stops_prefects_server_too(
    tmp_path: Path, tei: LocalTEIServer, whole_group: bool
) -> None:
    corpus = write_corpus(tmp_path / "kb", MANY_FILES)
    with LocalTEIServer(SLOW_TEI) as slow:
        env = {"QUARRY_DATA_DIR": str(tmp_path / "d"), "QUARRY_EMBED_URL": slow.url}
        # As `kill PID` or a scheduler stops a job: quarry alone gets the signal; as
        # systemd's default KillMode or `kill -TERM -PGID`, Prefect's server gets it too
        # (nightly trial: then Prefect reported the crash to it for minutes, exit 1).
        said = ctrl_c_when(
            ["ingest", str(corpus), "--json"],
            env,
            "Finished in state Completed",
            tmp_path / "err",
            sig=signal.SIGTERM,
            whole_group=whole_group,
        )
    assert "quarry: error: interrupted: a rerun picks up where this one stopped" in said
    # A script reading --json's stdout learns why the run ended.
    error = json.loads((tmp_path / "err.out").read_text())["error"]
    assert (error["type"], error["exit_code"]) == ("interrupted", 143)
    assert "a rerun picks up where this one stopped" in error["message"]


def test_a_killed_embedded_ingest_leaves_no_prefect_server_running(
    tmp_path: Path, tei: LocalTEIServer
) -> None:
    # Operator trial: after `kill -9` (or the OOM killer) the orphaned temporary
    # server ran on for good, one more after each such night.
    corpus = write_corpus(tmp_path / "kb", MANY_FILES)
    with LocalTEIServer(SLOW_TEI) as slow:
        env = {"QUARRY_DATA_DIR": str(tmp_path / "d"), "QUARRY_EMBED_URL": slow.url}
        ctrl_c_when(
            ["ingest", str(corpus)],
            env,
            "Beginning flow run",
            tmp_path / "err",
            sig=signal.SIGKILL,
            whole_group=False,
        )


def test_ctrl_c_during_an_embedded_reindex_drops_the_unfinished_collection(
    tmp_path: Path, tei: LocalTEIServer, prefect_api: str
) -> None:
    corpus = write_corpus(tmp_path / "kb", MANY_FILES)
    data = str(tmp_path / "d")
    served = {"QUARRY_DATA_DIR": data, "QUARRY_EMBED_URL": tei.url, "PREFECT_API_URL": prefect_api}
    assert run(["ingest", str(corpus)], served).returncode == 0
    before = json.loads(run(["collections", "--json"], served).stdout)
    with LocalTEIServer(SLOW_TEI) as slow:  # the same model, served slowly
        env = {"QUARRY_DATA_DIR": data, "QUARRY_EMBED_URL": slow.url}
        said = ctrl_c_when(["reindex", "--force", "--json"], env, "re-embedded", tmp_path / "err")
    assert "interrupted" in said
    error = json.loads((tmp_path / "err.out").read_text())["error"]
    assert (error["type"], error["exit_code"]) == ("interrupted", 130)
    # The half-built collection was dropped; the alias still points where it did.
    assert json.loads(run(["collections", "--json"], served).stdout) == before


CLEANING_COMMAND = """
import os, signal, sys, time
from quarry import cli
from flows import embedded_flow_runs

@cli.app.command("clean-up-demo")
def clean_up_demo() -> None:
    # As `quarry reindex` runs its flow: a run that cleans up after itself.
    with embedded_flow_runs("stopped", clean_up_s=10.0):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        finally:
            sys.stderr.write("cleaned up\\n")

sys.argv = ["quarry", "clean-up-demo"]
cli.main()
"""


def _embeds(method: str, path: str) -> bool:
    return method == "POST" and path in ("/embed", "/v1/embeddings")


def test_a_stop_under_a_prefect_server_waits_for_no_embedding_answer(
    tmp_path: Path, prefect_api: str
) -> None:
    # Operator trial: SIGTERM to an ingest under a Prefect server took 98 s against a
    # service answering in 20 s (the queued requests went out wave after wave, then
    # the exit joined the threads waiting on their answers). Only a rerun needs them.
    corpus = write_corpus(tmp_path / "kb", MANY_FILES)
    # Slow enough that no answer can land between the signal and the exit, however
    # busy the machine (a 4 s service once answered in that window under the suite).
    slow = LocalTEIConfig(backend="hash", dims=16, latency_ms=12000.0)
    served = {k: v for k, v in os.environ.items() if not k.startswith(("QUARRY_", "PREFECT_"))}
    with LocalTEIServer(slow) as service:
        served.update(
            QUARRY_DATA_DIR=str(tmp_path / "d"),
            QUARRY_EMBED_URL=service.url,
            PREFECT_API_URL=prefect_api,
        )
        log = tmp_path / "err"
        with log.open("w") as stderr:
            process = subprocess.Popen(
                [*QUARRY, "ingest", str(corpus), "--json"],
                env=served,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        try:
            deadline = time.monotonic() + 240
            # The canary, then the first batches' requests, are in flight.
            while sum(n for (m, path), n in service.stats.requests.items() if _embeds(m, path)) < 3:
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            answered = service.stats.responses.get(200, 0)
            process.send_signal(signal.SIGTERM)
            out, _ = process.communicate(timeout=60)
            # Gone before the service answered what was in flight.
            assert service.stats.responses.get(200, 0) == answered, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 143, log.read_text()
    assert json.loads(out)["error"]["type"] == "interrupted"
    assert "Traceback" not in log.read_text()


def test_sigterm_to_a_run_that_cleans_up_exits_143(tmp_path: Path) -> None:
    # As a reindex dropping its unfinished collection: the exit status still says SIGTERM.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUARRY_", "PREFECT_"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    result = subprocess.run(
        [sys.executable, "-c", CLEANING_COMMAND],
        capture_output=True,
        text=True,
        env=env,
        # On a busy machine the embedded Prefect server may use its whole startup allowance.
        timeout=EMBEDDED_STARTUP_TIMEOUT_S + 40,
        check=False,
    )
    assert "cleaned up" in result.stderr, result.stderr
    assert result.returncode == 143, result.stderr
    # Said as every failure is, once the clean-up is done (review: only the "cleaning
    # up" notice was printed).
    said = result.stderr[result.stderr.index("cleaned up") :]
    assert "quarry: error: interrupted: stopped\n" in said, result.stderr


def test_json_error_naming_a_non_utf8_path_is_valid_utf8_json(tmp_path: Path) -> None:
    # A name from `find` with a byte that is not UTF-8, under a locale whose stdout is
    # strict (en_US.UTF-8 is; C.UTF-8 escapes): still one parseable JSON document.
    name = os.fsdecode(bytes(tmp_path / "no") + b"\xff.md")
    result = subprocess.run(
        [*QUARRY, "chunk", name, "--json"],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "usage" and "\ufffd" in error["message"]


def test_ctrl_c_outside_a_flow_is_interrupted_in_json(tmp_path: Path) -> None:
    from quarry._http import NO_WAIT
    from quarry.chunking import Chunker
    from quarry.embeddings import EmbeddingClient
    from quarry.ingest import IndexSync, run_sync
    from quarry.sources import open_source
    from quarry.store import VectorStore, open_client

    corpus = write_corpus(tmp_path / "c", {"a.md": "# A\n\nSome text to find."})
    settings = Settings(data_dir=tmp_path / "d", collection="quarry")
    config = LocalTEIConfig(backend="hash", dims=16)
    with LocalTEIServer(config) as fast, EmbeddingClient(fast.url, retry=NO_WAIT) as embedder:
        store = VectorStore(open_client(settings), "quarry")
        run_sync(IndexSync(store, embedder, Chunker(64, 8)), [open_source(corpus)])
        store.close()
    # The same model, answering slowly: the query waits on its embedding when stopped.
    slow = LocalTEIConfig(backend="hash", dims=16, latency_ms=5000)
    with LocalTEIServer(slow) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUARRY_")}
        env.update({"QUARRY_EMBED_URL": server.url, "QUARRY_DATA_DIR": str(tmp_path / "d")})
        # As from a terminal: a non-interactive shell's background job (some CI) starts
        # with SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
        as_terminal = (
            "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
            " sys.argv = ['quarry', *sys.argv[1:]]; runpy.run_module('quarry', run_name='__main__')"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", as_terminal, "query", "some text", "--no-rerank", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 120
        while not any(method == "POST" for method, _ in server.stats.requests):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert json.loads(out)["error"] == {
        "type": "interrupted",
        "message": "interrupted",
        "exit_code": 130,
    }
    assert "interrupted" in err


# A command that is sent Ctrl-C at a chosen moment (the signal is real; the moment is
# made certain by sending it from the command itself).
CTRL_C_COMMAND = """
import os, signal, sys, time
from quarry import cli

signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
when = sys.argv[1]

@cli.app.command("ctrl-c-demo")
def ctrl_c_demo(as_json: cli.JsonFlag = False) -> None:
    if when == "loading":  # as while a command imports what it needs
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)

    def human() -> None:
        print("first line", flush=True)
        if when == "printing":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        print("second line")

    cli._emit(as_json, {"answer": 42}, human)
    if when == "printed":  # as during the teardown after the result
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)

sys.argv = ["quarry", "ctrl-c-demo", *sys.argv[2:]]
cli.main()
"""


def _ctrl_c_demo(when: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CTRL_C_COMMAND, when, *options],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_ctrl_c_before_a_command_handles_errors_is_still_said() -> None:
    # Model-migration trial: Ctrl-C a second into `quarry query --json` (while it
    # imported its modules) exited 130 with nothing on stdout or stderr.
    result = _ctrl_c_demo("loading", "--json")
    assert result.returncode == 130, result.stderr
    assert json.loads(result.stdout)["error"]["type"] == "interrupted"
    assert "quarry: error: interrupted" in result.stderr
    plain = _ctrl_c_demo("loading")
    assert (plain.returncode, plain.stdout) == (130, "")
    assert "quarry: error: interrupted" in plain.stderr


def test_a_stop_signal_after_the_exit_handlers_is_ignored_not_fatal() -> None:
    # Fault trial: Ctrl-C 0.2 s after `quarry ingest --json` printed its summary killed
    # the process by the signal (status 130 beside the success JSON): once the exit
    # handlers have run (Prefect's temporary server stopped), Python's finalization
    # gives SIGINT back its default. quarry's own handler runs last and ignores it.
    script = (
        "import atexit, os, signal, time\n"
        "from quarry import cli\n"
        "atexit._run_exitfuncs()  # as at the exit, quarry's handler last\n"
        "for sig in (signal.SIGINT, signal.SIGTERM):\n"
        "    os.kill(os.getpid(), sig)\n"
        "time.sleep(0.2)\n"
        "print('still here')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (0, "still here\n"), result.stderr


INTERRUPTED_IMPORT = """
import sys

class CtrlC:  # as a Ctrl-C while the command line's modules load
    def find_spec(self, name, path=None, target=None):
        if name == "quarry.cli":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
from quarry._entry import main

sys.argv = ["quarry", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("options", [[], ["--json"]])
def test_ctrl_c_while_the_command_line_loads_is_said_without_a_traceback(
    options: list[str],
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT, "status", *options],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr) == (130, "quarry: error: interrupted\n")
    if options:
        assert json.loads(result.stdout) == {
            "error": {"type": "interrupted", "message": "interrupted", "exit_code": 130}
        }
    else:
        assert result.stdout == ""


def test_ctrl_c_after_the_result_was_printed_leaves_the_result_standing() -> None:
    # Model-migration trial: Ctrl-C just after `quarry query --json` printed its
    # answer exited 130 with the complete answer on stdout.
    result = _ctrl_c_demo("printed", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"answer": 42}
    assert "interrupted" not in result.stderr


def test_ctrl_c_while_the_result_is_printed_lets_it_finish() -> None:
    result = _ctrl_c_demo("printing")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "first line\nsecond line\n"
    assert "interrupted" not in result.stderr


def test_json_equals_value_still_gets_a_json_usage_error() -> None:
    result = run(["status", "--json=1"], {})
    assert result.returncode == 2
    assert json.loads(result.stdout)["error"]["type"] == "usage"


def test_every_command_summary_is_one_line() -> None:
    """`quarry --help` lists each command by its docstring's first paragraph: a line
    break inside it shows as a broken sentence in the listing."""
    import typer.main

    from quarry.cli import app

    group = typer.main.get_command(app)
    assert isinstance(group, typer.main.TyperGroup)
    assert len(group.commands) >= 10
    for name, command in group.commands.items():
        summary = (command.help or "").strip().split("\n\n", 1)[0]
        assert summary and "\n" not in summary, f"quarry {name}: {summary!r}"


def test_collections_refuses_a_physical_collection_given_for_the_alias(tmp_path: Path) -> None:
    # Docs audit: it answered "no collections for alias ..." with exit 0.
    from qdrant_client import QdrantClient, models

    settings = Settings(data_dir=tmp_path / "d")
    settings.qdrant_path.mkdir(parents=True)
    client = QdrantClient(path=str(settings.qdrant_path))
    physical = "quarry__8c16ae3b1106__20261201235921"
    client.create_collection(physical, models.VectorParams(size=4, distance=models.Distance.COSINE))
    client.close()
    result = run(["collections", "-c", physical], {"QUARRY_DATA_DIR": str(tmp_path / "d")})
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "is a collection, not an alias" in result.stderr


def test_a_misspelt_setting_is_named_with_the_one_meant(tmp_path: Path) -> None:
    # Docs audit: QUARRY_EMBED_ULR and the like were ignored without a word.
    doc = write_corpus(tmp_path, {"a.md": "# A\n\nText."})
    env = {"QUARRY_EMBED_ULR": "http://x", "QUARRY_FROBNICATE": "1", "QUARRY_GIT_REPO": "r"}
    result = run(["chunk", str(doc / "a.md"), "--json"], env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["chunks"]  # stdout stays the JSON answer
    warnings = [line for line in result.stderr.splitlines() if "quarry: warning:" in line]
    assert warnings == [
        "quarry: warning: QUARRY_EMBED_ULR is not a quarry setting (did you mean "
        "QUARRY_EMBED_URL?); ignored",
        "quarry: warning: QUARRY_FROBNICATE is not a quarry setting; ignored",
    ]


def test_version() -> None:
    from quarry import __version__

    result = run(["--version"], {}, timeout=60)
    # make install-dev compiles the chunker here (hatch_build.py)
    assert (result.returncode, result.stdout) == (0, f"quarry {__version__} (chunker compiled)\n")


def test_include_help_names_the_default_globs() -> None:
    from typer.testing import CliRunner

    from quarry.cli import app
    from quarry.sources import DEFAULT_INCLUDE

    shown = CliRunner().invoke(app, ["ingest", "--help"], env={"COLUMNS": "200"}).output
    listed = re.search(r"\((\*\*/\*\.md[^)]*)\)", " ".join(shown.split()))
    assert listed is not None, shown
    suffixes = ["." + s.strip().rsplit(".", 1)[-1] for s in listed.group(1).split(",")]
    assert suffixes == ["." + glob.rsplit(".", 1)[-1] for glob in DEFAULT_INCLUDE]


def test_version_says_when_the_chunker_runs_as_plain_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from typer.testing import CliRunner

    from quarry.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "quarry._cpieces" else real(name, *a),
    )
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert "(chunker as plain Python: no C compiler or mypyc at install" in result.output


def test_help_names_every_option_whole_in_an_80_column_terminal() -> None:
    # Rich's help tables cut names short at 80 columns ("--allow-mass-dele…") and put
    # "<bool>" beside every flag; the plain help wraps the text instead.
    import typer.main
    from typer.testing import CliRunner

    from quarry.cli import app

    group = typer.main.get_command(app)
    assert isinstance(group, typer.main.TyperGroup)
    runner = CliRunner()
    listing = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    flat_listing = " ".join(listing.output.split())
    for name, command in group.commands.items():
        summary = " ".join((command.help or "").split("\n\n", 1)[0].split())
        assert summary in flat_listing, name  # whole, not cut to the terminal's width
        if name == "local-tei":  # argparse's own help (tested above)
            continue
        helped = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80"})
        assert helped.exit_code == 0, helped.output
        assert "…" not in helped.output and "<bool>" not in helped.output, helped.output
        for param in command.params:
            for option in (*param.opts, *param.secondary_opts):
                if option.startswith("-"):
                    assert option in helped.output, (name, option)
