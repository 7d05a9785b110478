"""The ingest flow end to end under a Prefect test harness, against a real local_tei."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.ingest import INGEST_PROGRESS, _progress_reporter
from quarry.errors import ConfigError, SourceError
from quarry.ingest import IngestProgress
from quarry.local_tei import LocalTEIConfig, LocalTEIServer
from tests.conftest import write_corpus

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(scope="module")
def tei() -> Iterator[LocalTEIServer]:
    with LocalTEIServer(LocalTEIConfig(backend="hash", dims=16)) as server:
        yield server


def test_flow_ingests_then_skips_unchanged(
    tmp_path: Path, tei: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.ingest import ingest_flow

    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    monkeypatch.setenv("QUARRY_WORKERS", "2")
    corpus = write_corpus(
        tmp_path / "kb",
        {f"doc{i}.md": f"# Doc {i}\n\nParagraph about topic {i}. " * 40 for i in range(70)},
    )
    (corpus / "bad.pdf").write_bytes(b"%PDF-1.4 truncated")
    past = time.time_ns() - 10 * 10**9  # not written just before the run: stamps vouch
    for path in corpus.iterdir():
        os.utime(path, ns=(past, past))
    states: list[IngestProgress] = []
    token = INGEST_PROGRESS.set(states.append)
    try:
        first = ingest_flow(sources=[str(corpus)], collection="flowtest")
    finally:
        INGEST_PROGRESS.reset(token)
    # Progress counts a file done once its batch is written: 64 documents, then the rest.
    assert states[0] == IngestProgress(0, 71, 0, 0, 0)
    assert any(0 < state.files_done < 71 for state in states)
    assert [s.files_done for s in states] == sorted(s.files_done for s in states)
    assert states[-1] == IngestProgress(71, 71, 70, first["chunks_embedded"], 1)
    assert first["documents_embedded"] == 70
    assert first["documents_failed"] == 1
    assert first["failures"][0]["uri"] == "kb/bad.pdf"
    assert set(first) >= {
        "documents_seen",
        "documents_skipped",
        "files_unread",
        "documents_embedded",
        "documents_deleted",
        "documents_failed",
        "chunks_embedded",
        "chunks_deleted",
        "embedding_requests",
        "failures",
        "collection",
    }
    second = ingest_flow(sources=[str(corpus)], collection="flowtest")
    assert (second["documents_skipped"], second["files_unread"]) == (70, 70)
    assert second["documents_embedded"] == 0
    assert second["embedding_requests"] == 0  # nothing to embed, not even the canary
    reread = ingest_flow(sources=[str(corpus)], collection="flowtest", reread=True)
    assert (reread["files_unread"], reread["documents_skipped"]) == (0, 70)
    assert reread["embedding_requests"] == 0


def test_a_long_run_logs_its_latest_progress_every_interval() -> None:
    logged: list[str] = []

    class Logger:
        def info(self, message: str, *args: object) -> None:
            logged.append(message % args)

    shown: list[IngestProgress] = []
    states = [IngestProgress(n, 10, n, 2 * n, 0) for n in range(3)]
    with _progress_reporter(Logger(), shown.append, every=3600.0) as report:
        for state in states:
            report(state)
    # Within the interval nothing is logged, but the live line sees every update.
    assert shown == states and logged == []
    with _progress_reporter(Logger(), None, every=0.02) as report:
        report(states[2])
        # No update comes (one batch is slow): the latest is logged all the same.
        deadline = time.monotonic() + 10
        while len(logged) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    after = len(logged)
    time.sleep(0.1)
    assert len(logged) == after >= 3  # and not after the run
    assert set(logged) == {"progress: 2 of 10 files done; embedded 2 documents (4 chunks)"}
    assert IngestProgress(1, 2, 0, 0, 1).describe().endswith("; 1 failed")


def test_flow_publishes_a_markdown_artifact(
    tmp_path: Path, tei: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.artifacts import Artifact

    from flows.ingest import ingest_flow

    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    corpus = write_corpus(tmp_path / "art", {"a.md": "hello artifact world"})
    ingest_flow(sources=[str(corpus)], collection="artifacts")
    artifact = Artifact.get("ingest-artifacts")
    assert artifact is not None
    assert "| 1 | 0 | 1 | 1 | 0 | 0 | 0 |" in str(artifact.data)  # seen ... new, changed ...


def test_a_run_asked_to_fail_on_failures_ends_failed_with_its_summary(
    tmp_path: Path, tei: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nightly trial: a run whose files were all unreadable ended Completed, exit 0, and
    # the automation on failed runs the operations guide sets up never fired.
    from flows.ingest import ingest_flow
    from quarry.errors import IngestIncomplete

    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    corpus = write_corpus(tmp_path / "strict", {"good.md": "# Good\n\nIndexed all the same."})
    (corpus / "bad.md").write_bytes(b"a\x00b")
    state = ingest_flow(
        sources=[str(corpus)], collection="strict", fail_on_failures=True, return_state=True
    )
    assert state.is_failed()
    with pytest.raises(IngestIncomplete, match=r"1 documents could not be indexed.*strict/bad.md"):
        state.result()
    # Without it, the same run is a success; the good file was indexed either way.
    summary = ingest_flow(sources=[str(corpus)], collection="strict")
    assert (summary["documents_seen"], summary["documents_skipped"]) == (1, 1)
    assert summary["documents_failed"] == 1


def test_a_flow_that_fails_on_purpose_logs_its_error_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As a deployment runs it: no CLI around it to install the filter first.
    import logging

    from flows.ingest import ingest_flow
    from quarry.errors import SourceError

    for name in ("prefect.flow_runs", "prefect.task_runs"):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    monkeypatch.setenv("QUARRY_EMBED_URL", "http://127.0.0.1:9")
    with caplog.at_level(logging.ERROR, logger="prefect.flow_runs"):
        with pytest.raises(SourceError):
            ingest_flow(sources=[str(tmp_path / "absent")], collection="quiet")
    failed = [r for r in caplog.records if "absent" in r.getMessage()]
    assert failed and all(r.exc_info is None and not r.exc_text for r in failed)
    # The collection's summary artifact says the last run failed, and why.
    from prefect.artifacts import Artifact

    artifact = Artifact.get("ingest-quiet")
    assert artifact is not None and "failed" in str(artifact.data)
    assert "absent" in str(artifact.data)

    # A Prefect API that cannot take the artifact does not hide the error itself.
    def unreachable(**kwargs: object) -> None:
        raise ConnectionError("All connection attempts failed")

    monkeypatch.setattr("flows.ingest.create_markdown_artifact", unreachable)
    with pytest.raises(SourceError):
        ingest_flow(sources=[str(tmp_path / "absent")], collection="quiet")


def test_the_terminal_gets_a_quarry_error_once_the_run_log_keeps_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import logging

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.logging.handlers import PrefectConsoleHandler

    from flows import _flush_prefect_logs, embedded_flow_runs
    from flows.ingest import ingest_flow
    from quarry.errors import SourceError

    terminal = io.StringIO()
    console = PrefectConsoleHandler(stream=terminal)
    monkeypatch.setattr(logging.getLogger(), "handlers", [console])
    monkeypatch.setenv("QUARRY_EMBED_URL", "http://127.0.0.1:9")
    missing = tmp_path / "missing-source-folder"
    with embedded_flow_runs(), pytest.raises(SourceError):  # as the CLI runs its flows
        ingest_flow(sources=[str(missing)], collection="said-once")
    said = terminal.getvalue()
    assert "Finished in state Failed: SourceNotFound" in said
    assert "missing-source-folder" not in said  # the CLI's own last line says it

    _flush_prefect_logs()  # as the CLI does before it exits
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        logs = client.read_logs(LogFilter(flow_run_id={"any_": [run.id]}))
    kept = [log.message for log in logs if "missing-source-folder" in log.message]
    assert any(m.startswith("Encountered exception") for m in kept)
    assert any(m.startswith("Finished in state Failed(") for m in kept)


def test_reindex_flow_gates_on_an_evaluation_in_local_mode(
    tmp_path: Path, tei: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.ingest import ingest_flow
    from flows.reindex import reindex_flow
    from quarry.errors import Refused

    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    tiny = Path(__file__).parent / "data" / "beir_tiny"
    corpus = write_corpus(tmp_path / "kb", {f"d{i}.md": f"Topic {i}. " * 30 for i in range(4)})
    ingest_flow(sources=[str(corpus)], collection="gated")
    # The evaluation runs on the flow's own clients: local-mode Qdrant admits one per process.
    passed = reindex_flow(collection="gated", eval_dataset=str(tiny), min_ndcg=0.0, force=True)
    assert passed["switched"] is True
    assert passed["evaluation"]["dataset"] == "beir_tiny"
    assert passed["evaluation"]["ndcg@10"] < 1.0
    with pytest.raises(Refused, match="below --min-ndcg"):
        reindex_flow(collection="gated", eval_dataset=str(tiny), min_ndcg=1.0, force=True)


@pytest.mark.parametrize(
    ("parameters", "error", "says"),
    [
        ({"min_ndcg": 0.5}, ConfigError, "min_ndcg needs eval_dataset"),
        ({"eval_dataset": "TINY", "min_ndcg": 60.0}, ConfigError, "between 0 and 1"),
        ({"eval_dataset": "typo", "min_ndcg": 0.5}, SourceError, "typo"),
        ({"exclude": ["*.md"]}, ConfigError, "need from_source"),
    ],
)
def test_reindex_flow_refuses_parameters_before_it_builds(
    tmp_path: Path,
    tei: LocalTEIServer,
    monkeypatch: pytest.MonkeyPatch,
    parameters: dict[str, Any],
    error: type[Exception],
    says: str,
) -> None:
    # Operator trial: a deployment run ignored min_ndcg without a dataset, and found a
    # mistyped dataset only after it had re-embedded the whole collection.
    from flows.reindex import reindex_flow

    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    monkeypatch.setenv("QUARRY_DATA_DIR", str(tmp_path / "data"))
    tiny = Path(__file__).parent / "data" / "beir_tiny"
    if parameters.get("eval_dataset") == "TINY":
        parameters = {**parameters, "eval_dataset": str(tiny)}
    elif "eval_dataset" in parameters:
        parameters = {**parameters, "eval_dataset": str(tmp_path / parameters["eval_dataset"])}
    with pytest.raises(error, match=says):
        reindex_flow(collection="nothing-yet", **parameters)
    # Refused before anything: not even the data dir's Qdrant was opened.
    assert not (tmp_path / "data" / "qdrant").exists()


def test_embedded_prefect_runs_flows_without_heartbeats_a_server_keeps_them() -> None:
    # A heartbeat thread held each flow run's exit for up to a second; only a Prefect
    # server can use heartbeats (an embedded one dies with the flow's process).
    from prefect.settings import get_current_settings, temporary_settings

    from flows import embedded_flow_runs

    default = get_current_settings().flows.heartbeat_frequency
    assert default is not None
    with temporary_settings(updates={"api.url": None}):
        with embedded_flow_runs():
            assert get_current_settings().flows.heartbeat_frequency is None
        assert get_current_settings().flows.heartbeat_frequency == default
    with temporary_settings(updates={"api.url": "http://prefect.test/api"}):
        with embedded_flow_runs():
            assert get_current_settings().flows.heartbeat_frequency == default


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_run_stopped_under_a_prefect_server_says_so(
    signum: int, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    # The signals stay Prefect's there (it marks the run crashed); the command still
    # says it was stopped, --json included, and exits 130 or 143.
    from prefect.settings import temporary_settings

    from flows import embedded_flow_runs

    told: list[tuple[int, str]] = []
    expected = (KeyboardInterrupt,) if signum == signal.SIGINT else (SystemExit,)
    # Python's own Ctrl-C handler, which a process started in the background of a
    # non-interactive shell lacks (SIGINT ignored from the start, as under some CI).
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous_sigint))
    with temporary_settings(updates={"api.url": "http://prefect.test/api"}):
        with pytest.raises(expected) as stopped:
            with embedded_flow_runs("rerun", on_stop=lambda *a: told.append(a)):
                os.kill(os.getpid(), signum)
                time.sleep(5)  # the handler raises before this ends
    if signum == signal.SIGTERM:
        assert isinstance(stopped.value, SystemExit) and stopped.value.code == 143
    assert told == [(128 + signum, "interrupted: rerun")]
    assert "interrupted: rerun" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_a_server_named_after_prefect_was_imported_keeps_the_heartbeats() -> None:
    # In a fresh process: the harness's own settings would hide the environment.
    import subprocess
    import sys

    code = (
        "import os, prefect.settings as s\n"
        "from flows import embedded_flow_runs\n"
        "os.environ['PREFECT_API_URL'] = 'http://prefect.test/api'\n"
        "with embedded_flow_runs():\n"
        "    c = s.get_current_settings()\n"
        "    print(c.api.url, c.flows.heartbeat_frequency)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    url, frequency = done.stdout.split()
    assert url == "http://prefect.test/api" and frequency != "None"


def test_embedded_runs_drop_only_the_events_workers_drain_notice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from prefect.settings import temporary_settings

    from flows import embedded_flow_runs

    with temporary_settings(updates={"api.url": None}), embedded_flow_runs():
        pass
    logger = logging.getLogger("EventsWorker")
    with caplog.at_level(logging.WARNING, logger="EventsWorker"):
        logger.warning("Still processing items: 1 items remaining...")
        logger.warning("Failed to send events")
    assert [r.getMessage() for r in caplog.records] == ["Failed to send events"]


def test_only_an_ingest_takes_a_file_that_is_gone_as_a_source(tmp_path: Path) -> None:
    # An ingest of a deleted file removes its documents; a reindex must read every
    # path, and a missing one is refused before anything is built.
    from flows.ingest import source_specs
    from quarry.errors import SourceNotFound

    gone = str(tmp_path / "old.md")
    assert source_specs([gone], None, None, missing_file_ok=True)[0].file is not None
    with pytest.raises(SourceNotFound, match="no such file"):
        source_specs([gone], None, None)


def test_the_artifact_table_escapes_a_pipe_in_a_file_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.ingest import _publish_artifact
    from quarry.ingest import Failure, IngestReport

    published: list[str] = []
    monkeypatch.setattr(
        "flows.ingest.create_markdown_artifact",
        lambda markdown, **kwargs: published.append(markdown),
    )
    report = IngestReport(collection="kb", failures=[Failure("c/bro|ken.pdf", "broken PDF")])
    _publish_artifact(report, ["c"], 1.0)
    [row] = [line for line in published[0].splitlines() if "ken.pdf" in line]
    # GitHub-flavoured Markdown splits a cell at every unescaped |, in a code span too.
    assert row == "| `c/bro\\|ken.pdf` | broken PDF |"


def test_collections_whose_names_differ_only_in_case_or_underscores_keep_apart_artifacts() -> None:
    from flows.ingest import _artifact_key

    keys = {_artifact_key(name) for name in ("my-docs", "My_Docs", "my_docs", "MY-DOCS")}
    assert len(keys) == 4
    assert _artifact_key("my-docs") == "ingest-my-docs"
    assert all(re.fullmatch(r"[a-z0-9-]+", key) for key in keys)


def test_a_writer_that_waits_past_quarry_writer_wait_gives_up_naming_it(
    tmp_path: Path, tei: LocalTEIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nightly trial: a second ingest on the same data waited for ever, so cron jobs
    # piled up without a word.
    from filelock import FileLock

    from flows.ingest import ingest_flow
    from quarry.config import Settings
    from quarry.errors import StoreLocked
    from quarry.store import writer_lock_path

    monkeypatch.setenv("QUARRY_EMBED_URL", tei.url)
    monkeypatch.setenv("QUARRY_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("QUARRY_WRITER_WAIT", "0.5")
    corpus = write_corpus(tmp_path / "kb", {"a.md": "# A\n\nText."})
    lock = writer_lock_path(Settings(data_dir=tmp_path / "d"))
    lock.parent.mkdir(parents=True, exist_ok=True)
    held, done = threading.Event(), threading.Event()

    def other_writer() -> None:  # as another process's ingest holds it
        with FileLock(str(lock)):
            held.set()
            done.wait(60)

    holder = threading.Thread(target=other_writer)
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(StoreLocked, match=r"after 0.5s \(QUARRY_WRITER_WAIT\)") as refused:
            ingest_flow(sources=[str(corpus)], collection="waits")
        # The lock is the folder's, whatever the other writer's collection (review: the
        # message named this run's collection as the one being written).
        assert f"writing to local-mode Qdrant in {tmp_path / 'd'} after" in str(refused.value)
    finally:
        done.set()
        holder.join()
    monkeypatch.delenv("QUARRY_WRITER_WAIT")
    assert ingest_flow(sources=[str(corpus)], collection="waits")["documents_embedded"] == 1


def test_an_incomplete_ingest_keeps_its_summary_when_stored_and_loaded() -> None:
    # Review: Prefect may pickle a failed run's exception; the summary must survive it.
    import pickle

    from quarry.errors import IngestIncomplete

    summary = {"documents_failed": 1, "failures": [{"uri": "kb/bad.md", "error": "binary"}]}
    loaded = pickle.loads(pickle.dumps(IngestIncomplete("kb", summary)))
    assert (loaded.collection, loaded.summary, str(loaded)) == (
        "kb",
        summary,
        "ingest of 'kb': 1 documents could not be indexed (fail on failures); first: "
        "kb/bad.md: binary",
    )


def test_every_quarry_error_survives_being_stored_and_loaded() -> None:
    # Prefect may pickle a failed task's exception; the url, collection or uri with it.
    import pickle

    from quarry.errors import (
        FingerprintMismatch,
        ServiceUnavailable,
        StoreUnavailable,
        UnreadableDocument,
    )

    errors = [
        ServiceUnavailable("http://tei:80/embed", "cannot connect", status=503),
        StoreUnavailable("quarry__abc", "upsert of 3 points failed: database or disk is full"),
        UnreadableDocument("kb/a.pdf", "truncated PDF"),
        FingerprintMismatch("index made by model A; the service serves model B"),
    ]
    for error in errors:
        loaded = pickle.loads(pickle.dumps(error))
        assert type(loaded) is type(error) and str(loaded) == str(error)
        assert vars(loaded) == vars(error)


def test_an_embedded_prefect_on_a_full_disk_is_one_clear_error_not_a_long_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import flows
    from quarry.errors import QuarryError

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    (tmp_path / "prefect").mkdir()
    started: list[int | None] = []

    class Server:
        def start(self, timeout: int | None = None) -> None:
            started.append(timeout)
            raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect")

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(flows.shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**20))
    with pytest.raises(QuarryError, match=r"3\.0 MiB free: free some space") as full:
        flows._start_embedded_server(Server())
    assert str(tmp_path / "prefect") in str(full.value) and started == []  # not waited on
    monkeypatch.setattr(flows.shutil, "disk_usage", lambda path: usage._replace(free=2**30))
    with pytest.raises(QuarryError, match=r"did not start: Timed out.*1024 MiB free"):
        flows._start_embedded_server(Server())
    # quarry's allowance, not Prefect's 20 s, even where configure_prefect_environment
    # did not run (CI: the first start of a fresh database outlasted 20 s).
    assert started == [flows.EMBEDDED_STARTUP_TIMEOUT_S]


def test_a_startup_allowance_set_for_prefect_wins_over_quarrys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows import EMBEDDED_STARTUP_TIMEOUT_S, _startup_timeout_s

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "45")
    assert _startup_timeout_s() == 45
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "soon")
    assert _startup_timeout_s() == EMBEDDED_STARTUP_TIMEOUT_S
