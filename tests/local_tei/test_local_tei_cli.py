"""``python -m quarry.local_tei``: a foreground service in its own process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from local_tei_support import StartServer, http_client

from quarry.local_tei.__main__ import main


def _read_url(proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        match = re.search(r"(http://\S+)", line)
        if match:
            return match.group(1)
        if not line and proc.poll() is not None:
            break
    raise AssertionError("the service printed no URL")


def test_module_serves_prints_its_url_and_stops_on_sigint(start_server: StartServer) -> None:
    cmd = [sys.executable, "-m", "quarry.local_tei", "--backend", "hash", "--port", "0"]
    cmd += ["--seed", "7", "--max-client-batch-size", "4"]
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # another process, another str hash seed
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _read_url(proc)
        in_process = start_server(seed=7)
        with http_client(url) as remote, http_client(in_process.url) as local:
            assert remote.get("/health").status_code == 200
            assert remote.get("/info").json()["max_client_batch_size"] == 4
            body = {"inputs": ["determinism across processes"]}
            np.testing.assert_array_equal(
                remote.post("/embed", json=body).json(), local.post("/embed", json=body).json()
            )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_module_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--backend", "hash", "--fault-rate", "2"])
    assert exit_info.value.code == 2
    assert "fault_rate must be in [0, 1]" in capsys.readouterr().err
