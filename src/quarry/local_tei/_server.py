"""Running the app: in a background thread (tests, the embedded default) or blocking (CLI)."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

import uvicorn
from fastapi import FastAPI

from ._app import create_app
from ._config import LocalTEIConfig
from ._stats import ServerStats

__all__ = ["LocalTEIServer", "serve"]

_STARTUP_TIMEOUT_S = 300.0  # loading the model from a cold disk can take a while
_STOP_TIMEOUT_S = 30.0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it a response written in two parts waits for a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _url(host: str, port: int) -> str:
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with a hook that runs once it accepts connections."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal after its graceful shutdown, which kills the
        # process (or raises KeyboardInterrupt) after all; for this foreground service a
        # signal is the normal way to stop, so serve() just returns.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


_THREAD_PREFIX = "local-tei-"


class _QuietInHost(logging.Filter):
    """Keeps an embedded service's INFO lines ("Uvicorn running on ...", its port) out of
    the host's log: uvicorn logs every server's on one logger, "uvicorn.error", which
    the host's own server (``quarry api``) shares."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not (record.threadName or "").startswith(
            _THREAD_PREFIX
        )


_QUIET_IN_HOST = _QuietInHost()


def _uvicorn_config(app: FastAPI, *, own_logging: bool) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        # In a host process (tests, the embedded default) uvicorn must not reconfigure
        # logging, nor set the level of its loggers, which the host's own server shares
        # (its "Uvicorn running on" line went missing); _QuietInHost quiets this one.
        log_config=uvicorn.config.LOGGING_CONFIG if own_logging else None,
        log_level="warning" if own_logging else None,
        access_log=False,
        lifespan="on",
        # TEI (hyper) keeps idle connections open; a short idle timeout makes pooled
        # clients race the server's close and fail requests that were never received.
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,
        backlog=4096,
    )


class LocalTEIServer:
    """A local TEI-compatible service on uvicorn, in a background thread of this process.

    ``start()`` returns once the service accepts connections (with ``port=0`` it binds
    a free port; ``url`` says which). ``stop()`` shuts it down and joins the thread;
    it is idempotent. Usable as a context manager.
    """

    def __init__(self, config: LocalTEIConfig) -> None:
        self.config = config
        self.stats = ServerStats()
        self.url = ""
        self._server: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        """The bound port (0 before ``start()``)."""
        return int(self._sock.getsockname()[1]) if self._sock is not None else 0

    def start(self) -> LocalTEIServer:
        """Bind, start uvicorn in a thread, and wait until it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("LocalTEIServer.start() called twice")
        sock = _bind(self.config.host, self.config.port)
        self._sock = sock
        ready = threading.Event()
        app = create_app(self.config, stats=self.stats)
        logging.getLogger("uvicorn.error").addFilter(_QUIET_IN_HOST)  # kept once: not re-added
        server = _Uvicorn(_uvicorn_config(app, own_logging=False), ready.set)
        self._server = server

        def run() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # SystemExit from a failed startup included
                self._error = exc
            finally:
                ready.set()

        thread = threading.Thread(target=run, name=f"{_THREAD_PREFIX}{self.port}", daemon=True)
        self._thread = thread
        thread.start()
        if not ready.wait(_STARTUP_TIMEOUT_S) or not server.started:
            self.stop()
            cause = getattr(app.state, "startup_error", None) or self._error
            raise RuntimeError(f"local TEI service did not start: {cause!r}") from cause
        self.url = _url(self.config.host, self.port)
        return self

    def stop(self) -> None:
        """Shut the service down and join its thread; a no-op if it is not running."""
        server, thread, sock = self._server, self._thread, self._sock
        if server is not None:
            server.should_exit = True
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_TIMEOUT_S)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(_STOP_TIMEOUT_S)
        if sock is not None:
            sock.close()
        self._server = None
        self._thread = None
        self._sock = None

    def __enter__(self) -> LocalTEIServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(config: LocalTEIConfig) -> None:
    """Run the service in the foreground until interrupted; prints its URL to stderr."""
    sock = _bind(config.host, config.port)
    url = _url(config.host, int(sock.getsockname()[1]))

    def announce() -> None:
        print(
            f"quarry local-tei: {config.backend} backend serving the TEI API at {url}",
            file=sys.stderr,
            flush=True,
        )

    server = _Uvicorn(_uvicorn_config(create_app(config), own_logging=True), announce)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
