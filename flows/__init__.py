"""Prefect flows: thin wiring of quarry's stages (``quarry.ingest``, ``quarry.search``)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

# How long Prefect's temporary server may take to start: the first start migrates a
# fresh SQLite database, and on 2 slow cores that takes a while.
EMBEDDED_STARTUP_TIMEOUT_S = 240


def configure_prefect_environment(data_dir: Path) -> None:
    """Point an embedded (ephemeral) Prefect at ``data_dir`` and keep it quiet and offline.

    Call before importing prefect. Does nothing to a process that talks to a
    Prefect server (``PREFECT_API_URL`` set): that server's settings win.
    """
    if os.environ.get("PREFECT_API_URL"):
        return
    home = Path(os.environ.setdefault("PREFECT_HOME", str((data_dir / "prefect").resolve())))
    from quarry.config import make_data_folder

    make_data_folder(data_dir, home, "Prefect")  # Prefect creates only the last level
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EMBEDDED_STARTUP_TIMEOUT_S)
    )
    os.environ.setdefault("PREFECT_LOGGING_SERVER_LEVEL", "WARNING")


@contextmanager
def embedded_flow_runs(
    interrupted: str = "",
    *,
    clean_up_s: float = 0.0,
    on_stop: Callable[[int, str], None] | None = None,
    exit_when_stopped: bool = False,
) -> Iterator[None]:
    """Run flows in this block as an embedded Prefect suits: no heartbeats, and Ctrl-C
    stops the process at once (saying ``interrupted``, exit 130), or, with
    ``clean_up_s``, after at most that long for the run's own clean-up.

    A heartbeat (Prefect's default: every 180 s, from a thread that sleeps in
    one-second steps) lets a server notice that a run's process died; it also holds
    every flow run's exit for up to a second while that thread wakes up, which was
    most of a re-ingest's time. An embedded (ephemeral) server lives in the process
    that runs the flow and dies with it, so there is no one to notice.

    That server is a child in the terminal's process group: Ctrl-C stops it too, and
    Prefect then spent minutes retrying it (tracebacks, exit 1) while the batches in
    flight went on. quarry's runs are built to survive being killed at any point (a
    rerun resumes, nothing lost or written twice), so the first Ctrl-C stops the
    server and exits. A run that cleans up after itself (a reindex drops its
    unfinished collection) gets KeyboardInterrupt instead, and ``clean_up_s`` to
    finish before the process exits all the same; a second Ctrl-C exits at once.
    SIGTERM is handled the same way. With a Prefect server (``PREFECT_API_URL``)
    the signals stay Prefect's; a stopped run is still said to be, as above, and
    with ``exit_when_stopped`` (the command line) the process ends once the run has
    wound down and told the server: embedding requests still in flight are not
    waited for (their answers would be thrown away).
    """
    from prefect.settings import temporary_settings

    # Settings read afresh: PREFECT_API_URL may have been set since prefect was imported.
    _say_quarry_errors_once()
    with temporary_settings() as current:
        if current.api.url:
            with _say_when_stopped(interrupted, on_stop, exit_when_stopped):
                yield
            return
        _filter_once("EventsWorker", _NoDrainNotice)
        with (
            temporary_settings(updates={"flows.heartbeat_frequency": None}),
            _stop_on_signals(interrupted, clean_up_s, on_stop),
        ):
            _reap_the_embedded_server_when_gone()
            yield


@contextmanager
def _say_when_stopped(
    note: str, on_stop: Callable[[int, str], None] | None = None, exit_now: bool = False
) -> Iterator[None]:
    """With a Prefect server, signals stay Prefect's (the run's batches wind down, the
    server hears of the crash); say that the run was stopped all the same, and exit
    with 130 (Ctrl-C) or 143 (SIGTERM).

    Prefect answers SIGTERM by marking the run crashed, then sends it again to the
    handler it found: the one set here, which ends the command as Ctrl-C would.
    """
    said = f"interrupted{': ' + note if note else ''}"
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        yield
    except KeyboardInterrupt:
        code = 143 if terminated else 130
        if previous is not None:  # a second signal ends the process as it would have
            signal.signal(signal.SIGTERM, previous)
            previous = None
        _say_stopped(said)
        if on_stop is not None:
            on_stop(code, said)
        if exit_now:
            # The flow run has recorded its crash and released its locks; what is left
            # are threads waiting on abandoned requests, which a normal exit joins.
            _flush_prefect_logs()
            sys.stdout.flush()
            os._exit(code)
        if terminated:
            raise SystemExit(code) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def _stop_on_signals(
    note: str, clean_up_s: float, on_stop: Callable[[int, str], None] | None = None
) -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM (``kill``, systemd, cron's timeouts) both stop the run
    so: Python's default for SIGTERM ends the process at once and left Prefect's
    temporary server running, orphaned. Exit status 128 + the signal's number;
    ``on_stop(status, message)`` is called once before the process ends so."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    said = f"interrupted{': ' + note if note else ''}"
    received: list[int] = []  # the signal a clean-up started on
    told: list[int] = []

    def tell(code: int) -> None:
        if on_stop is not None and not told:
            told.append(code)
            on_stop(code, said)

    def exit_now(code: int) -> None:
        _say_stopped(said)
        tell(code)
        sys.stdout.flush()
        _stop_embedded_prefect_server()
        os._exit(code)

    def stop(signum: int, frame: FrameType | None) -> None:
        if not clean_up_s or received:
            exit_now(128 + signum)
        received.append(signum)
        again = "Ctrl-C" if signum == signal.SIGINT else "the signal"
        sys.stderr.write(f"\nquarry: {said} (cleaning up; {again} again to stop at once)\n")
        sys.stderr.flush()
        # Prefect then reports the crash to its server, which the terminal's Ctrl-C
        # stopped too: that would take minutes of retries.
        watchdog = threading.Timer(clean_up_s, exit_now, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    _STOPPING.append(stop)
    try:
        yield
    except KeyboardInterrupt:
        # Cleaned up: the exit status still says which signal stopped the run (the
        # command line turns a KeyboardInterrupt into 130, SIGINT's).
        if received:
            _say_stopped(said)
        tell(128 + (received[0] if received else signal.SIGINT))
        if received and received[0] != signal.SIGINT:
            raise SystemExit(128 + received[0]) from None
        raise
    finally:
        _STOPPING.remove(stop)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say_stopped(said: str) -> None:
    """The stopped run's error line on stderr, as the command line says every failure."""
    sys.stderr.write(f"\nquarry: error: {said}\n")
    sys.stderr.flush()


# The handler _stop_on_signals installed, while it is in force (innermost last).
_STOPPING: list[Callable[[int, FrameType | None], None]] = []


def take_back_sigterm() -> None:
    """In a flow run under an embedded Prefect, make SIGTERM quarry's again (a no-op
    elsewhere); call it first thing in a flow's body.

    Prefect's flow engine puts its own handler in for the run: it reports a crash to
    the server, then passes the signal on. Sent to the whole process group (systemd's
    default KillMode, ``kill -TERM -PGID``), SIGTERM stops the embedded server too,
    and that report was retried against it for minutes before the command exited 1,
    with no JSON on stdout. Ctrl-C (SIGINT) already stops at once, unreported.
    """
    if _STOPPING and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _STOPPING[-1])


def _flush_prefect_logs() -> None:
    """Send the run's last log lines to the Prefect server before an abrupt exit."""
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
    except Exception:  # the exit goes ahead: the server already knows the run crashed
        pass


# Run by a child of its own session (a terminal's Ctrl-C does not reach it): it reads
# its stdin until the process that started it is gone, however it went (SIGKILL, the
# OOM killer), then stops that process's Prefect server if it is still the one running.
_REAPER = """
import os, signal, sys
pid, port = int(sys.argv[1]), sys.argv[2].encode()
sys.stdin.buffer.read()
try:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        argv = handle.read().split(b"\\0")
except OSError:
    sys.exit(0)
if b"prefect.server.api.server:create_app" in argv and port in argv:
    os.kill(pid, signal.SIGTERM)
"""


def _reap_the_embedded_server_when_gone() -> None:
    """Start Prefect's temporary server now, and a reaper that stops it if this process
    dies without stopping it (a ``kill -9`` or an OOM kill spares atexit and signal
    handlers, and the orphaned server ran on for good, one more each such night).

    Prefect starts the same server (one per process) on a flow's first call anyway;
    started here, its process id is known before any flow runs. Linux only (``/proc``
    tells the reaper that the pid is still the server's): elsewhere nothing is reaped.
    """
    if not Path("/proc/self/cmdline").exists():
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    _start_embedded_server(server)
    process = server.server_process
    if process is None or process.poll() is not None or process.pid in _REAPERS:
        return
    _REAPERS[process.pid] = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REAPER, str(process.pid), str(server.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


# A fresh embedded Prefect database takes about 5 MB; a disk with less than this free
# cannot hold it and the first batches of an index, and Prefect would retry its start
# for EMBEDDED_STARTUP_TIMEOUT_S before failing.
MIN_FREE_BYTES = 16 * 1024 * 1024


def _start_embedded_server(server: Any) -> None:
    """Start Prefect's temporary server, or raise a QuarryError that says why it cannot
    (a full disk under QUARRY_DATA_DIR, which Prefect reports as a timeout)."""
    from quarry.errors import QuarryError

    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    try:
        free = shutil.disk_usage(home).free
    except OSError:
        free = None
    where = f"Prefect's embedded database at {home} (PREFECT_HOME; by default in QUARRY_DATA_DIR)"
    if free is not None and free < MIN_FREE_BYTES:
        raise QuarryError(
            f"{where} is on a disk with {free / 2**20:.1f} MiB free: free some space, or "
            "point QUARRY_DATA_DIR at a disk that has it"
        )
    try:
        # Explicit, so the allowance holds in a process that skipped
        # configure_prefect_environment (Prefect's own default is 20 s).
        server.start(timeout=_startup_timeout_s())
    except RuntimeError as error:
        space = f"; its disk has {free / 2**20:.0f} MiB free" if free is not None else ""
        raise QuarryError(f"{where} did not start: {error}{space}") from error


def _startup_timeout_s() -> int:
    """PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS where it is set, else quarry's allowance."""
    setting = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "")
    try:
        return max(1, round(float(setting)))
    except ValueError:
        return EMBEDDED_STARTUP_TIMEOUT_S


# The reapers' pipes, held open for the life of this process (their end is its end).
_REAPERS: dict[int, subprocess.Popen[bytes]] = {}


def _stop_embedded_prefect_server() -> None:
    """Terminate Prefect's temporary server (a Ctrl-C sent to this process alone spares
    it, and an exit without atexit handlers would leave it running)."""
    try:
        from prefect.server.api.server import SubprocessASGIServer

        servers = list(getattr(SubprocessASGIServer, "_instances", {}).values())
    except Exception:  # Prefect moved it: the terminal's Ctrl-C reached it anyway
        return
    for server in servers:
        process = getattr(server, "server_process", None)
        if process is not None and process.poll() is None:
            process.terminate()


class _NoDrainNotice(logging.Filter):
    """Drops Prefect's "Still processing items" warning: at exit its events worker
    still sends the run's last event (the summary artifact's), and says so. The
    heartbeat's one-second wait used to hide it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Still processing items")


def _filter_once(logger_name: str, kind: type[logging.Filter]) -> None:
    """Add a ``kind`` filter to the logger unless it has one (calls repeat per command)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())


class _NoQuarryTraceback(logging.Filter):
    """Drops the traceback from Prefect's log line for a flow or task that raised a
    QuarryError: those errors say what is wrong and what to do on their own, and the
    CLI prints that as its last line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from quarry.errors import QuarryError

        if record.exc_info and isinstance(record.exc_info[1], QuarryError):
            record.exc_info = None
            record.exc_text = None
            record.quarry_error = True  # for _QuarryErrorSaidOnce, on the terminal
        return True


# Prefect's last line for a run: "Finished in state Failed('Flow run encountered an
# exception: FingerprintMismatch: <the whole message>')".
_FINISHED_WITH = re.compile(r"Finished in state (\w+)\(.*?encountered an exception: (\w+): ", re.S)


class _QuarryErrorSaidOnce(logging.Filter):
    """On the terminal, where the CLI ends with the error: drops Prefect's line that
    repeats a QuarryError a flow raised, and cuts the message out of the run's final
    state line. The run's log on the server (its own handler) keeps both whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        from quarry.errors import QuarryError

        if getattr(record, "quarry_error", False):
            return False
        message = record.getMessage()
        if message.startswith("Finished in state "):
            found = _FINISHED_WITH.match(message)
            if found and found[2] in _error_names(QuarryError):
                record.msg, record.args = f"Finished in state {found[1]}: {found[2]}", ()
        return True


def _error_names(base: type[Exception]) -> set[str]:
    names, kinds = set(), [base]
    while kinds:
        kind = kinds.pop()
        names.add(kind.__name__)
        kinds.extend(kind.__subclasses__())
    return names


def _say_quarry_errors_once() -> None:
    """Install :class:`_QuarryErrorSaidOnce` on Prefect's terminal handlers (idempotent)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()  # the handlers exist from here on
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _QuarryErrorSaidOnce) for f in handler.filters
        ):
            handler.addFilter(_QuarryErrorSaidOnce())


def quiet_quarry_tracebacks() -> None:
    """Install :class:`_NoQuarryTraceback` on Prefect's run loggers (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        _filter_once(name, _NoQuarryTraceback)
