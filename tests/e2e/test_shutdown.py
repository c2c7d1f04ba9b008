"""SIGTERM ends the whole tree without force-killing any child (so within the launcher's
grace period, inside 10 s), also while a worker waits in its crash-loop back-off."""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import children, title

pytestmark = pytest.mark.slow


def test_sigterm_right_after_worker_deaths_ends_everything_cleanly(
    default_model_path: Path,
) -> None:
    srv = LaunchedServer(
        [
            "--model",
            str(default_model_path),
            *shlex.split("--device cpu --kv-cache-tokens 2048 --max-model-len 512"),
        ]
    )
    srv.wait_ready()
    tree = children(srv.proc.pid)
    decode = next(pid for pid in tree if title(pid) == "pdserve:decode-0")
    os.kill(decode, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not any("restarting in" in line for line in srv.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("killed by SIGKILL" in line for line in srv.log), "".join(srv.log[-20:])
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(30)
    log = "".join(srv.log)
    assert srv.proc.returncode == 0, log[-3000:]
    # No child needed SIGKILL, so all left within the launcher's 8 s grace (10 s promise).
    assert "killing it" not in log
    assert not [pid for pid in tree if os.path.exists(f"/proc/{pid}")]
