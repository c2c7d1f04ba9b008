"""Crash loops: back-off, then a FAILED worker with how it died; a role with none left ends
the server, also during startup."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from frontend.settings import ConnectionLimits, FrontendLaunch, FrontendSettings
from launcher import supervisor
from launcher.supervisor import Child, ChildFailed, Supervisor, restart_delay
from launcher.topology import Topology
from runtime.strict_spec import encode_spec
from runtime.worker_spec import EngineWorkerSpec
from transport.load_table import WorkerState, describe_exit
from wire.roles import Role

REPO = Path(__file__).resolve().parents[2]


def test_restart_delay_doubles_up_to_its_cap() -> None:
    delays = [restart_delay(n) for n in range(1, 10)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == supervisor.RESTART_MAX_S
    assert delays == sorted(delays)


def test_exit_status_in_words_names_the_oom_killer_for_sigkill() -> None:
    assert describe_exit(1) == "exited with code 1"
    assert "SIGKILL" in describe_exit(-9) and "OOM killer" in describe_exit(-9)
    assert describe_exit(-15) == "killed by SIGTERM"


def test_a_worker_that_always_dies_at_startup_ends_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor, "RESTART_BASE_S", 0.01)
    topo = Topology(0, 1, 1)
    # A decode worker whose checkpoint does not exist dies in its first second, every time.
    spec = EngineWorkerSpec("error", EngineConfig(model=str(tmp_path / "missing")), "shm")
    settings = encode_spec(spec)
    child = Child(topo.spec(Role.DECODE, 0, settings), {})
    sup = Supervisor([child], topo.load_table(), 0)
    sup.start_all()
    with pytest.raises(ChildFailed, match="every decode worker failed"):
        for _ in range(400):  # each death is one interpreter start: well under a minute
            sup._tend(0.5)
    assert child.failed is not None and "exited with code 1" in child.failed
    assert child.restarts == supervisor.MAX_CRASHES - 1
    (row,) = [r for r in topo.load_table().snapshot() if r.index == 0 and r.role is Role.DECODE]
    assert row.state is WorkerState.FAILED and row.exit_status == 1
    sup.shutdown()


def test_frontends_are_restarted_like_workers_and_marked_on_their_board(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dying frontend no longer ends the server: it is restarted (its board row DEAD
    meanwhile), and only when every frontend has failed does the server give up."""
    monkeypatch.setattr(supervisor, "RESTART_BASE_S", 0.01)
    topo = Topology(0, 1, 1, num_frontends=2)
    # A well-formed spec whose checkpoint does not exist: it dies loading the tokenizer.
    http = FrontendSettings(model_name="m", max_model_len=64, vocab_size=64)
    settings = FrontendLaunch(
        model=str(tmp_path / "missing"),
        http=http,
        connections=ConnectionLimits(),
        router_policy="least-load",
        max_waiting_requests=None,
        max_queued_prefill_tokens=None,
        stall_timeout_s=5.0,
        node="a",
        log_level="error",
    ).to_json()
    kids = [Child(topo.spec(Role.FRONTEND, n, settings), {}) for n in range(2)]
    board = topo.board()
    sup = Supervisor(kids, topo.load_table(), 0, board)
    sup.start_all()
    seen = set()
    with pytest.raises(ChildFailed, match="every frontend worker failed"):
        for _ in range(400):
            sup._tend(0.5)
            seen |= {f.state for f in board.frontends()}
    assert WorkerState.DEAD in seen
    assert [f.state for f in board.frontends()] == [WorkerState.FAILED] * 2
    assert all(k.restarts == supervisor.MAX_CRASHES - 1 for k in kids)
    sup.shutdown()


def test_launch_whose_every_worker_dies_exits_with_the_reason(
    default_model_path: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(default_model_path, broken)
    # The header still reads (the launcher sizes memory from it); the tensors do not load.
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "--model",
            str(broken),
            *shlex.split("--device cpu --port 0 --kv-cache-tokens 1024 --log-level warning"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # five model loads
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "no longer restarted" in out.stderr and "failed" in out.stderr
    assert "pdserve is serving" not in out.stdout
