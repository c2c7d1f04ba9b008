"""Crash loops: back-off, then a FAILED worker with how it died; a role with none left ends
the server, also during startup."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from frontend.engine_link.board import FrontendBoard
from frontend.settings import ConnectionLimits, FrontendLaunch, FrontendSettings
from launcher import supervisor
from launcher.supervisor import Child, ChildFailed, Supervisor, failed_backoff, restart_delay
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


def test_failed_backoff_doubles_up_to_five_minutes() -> None:
    waits = [failed_backoff(n) for n in range(1, 12)]
    assert waits[:2] == [supervisor.FAILED_BASE_S, 2 * supervisor.FAILED_BASE_S]
    assert max(waits) == supervisor.FAILED_MAX_S == 300.0
    assert waits == sorted(waits)


def test_exit_status_in_words_names_the_oom_killer_for_sigkill() -> None:
    assert describe_exit(1) == "exited with code 1"
    assert "SIGKILL" in describe_exit(-9) and "OOM killer" in describe_exit(-9)
    assert describe_exit(-15) == "killed by SIGTERM"


def test_a_worker_that_always_dies_at_startup_ends_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor, "RESTART_BASE_S", 0.01)
    monkeypatch.setattr(supervisor, "CRASH_WINDOW_S", 600.0)  # 5 lives, however slow
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
    # Each start imports the tokenizer stack: on a loaded host 5 lives outlast a minute.
    monkeypatch.setattr(supervisor, "CRASH_WINDOW_S", 600.0)
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


def _dying_decode(topo: Topology, tmp_path: Path, index: int) -> Child:
    """A decode worker whose checkpoint does not exist: it dies in its first second."""
    spec = EngineWorkerSpec("error", EngineConfig(model=str(tmp_path / "missing")), "shm")
    return Child(topo.spec(Role.DECODE, index, encode_spec(spec)), {})


def _alive_decode(topo: Topology, index: int) -> Child:
    """A decode worker that stays up (a sleeping process stands in for it)."""
    child = Child(topo.spec(Role.DECODE, index, {}), {})
    child.proc = subprocess.Popen(["sleep", "600"])
    child.pidfd = os.pidfd_open(child.proc.pid)
    return child


def test_a_crash_looping_worker_is_retried_after_its_backoff_shown_on_the_board(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its crash-loop limit a worker is FAILED, the board says when it comes back,
    and it is started again then, while the other worker of its role serves on."""
    monkeypatch.setattr(supervisor, "RESTART_BASE_S", 0.01)
    monkeypatch.setattr(supervisor, "EXPLAIN_GRACE_S", 0.05)
    monkeypatch.setattr(supervisor, "FAILED_BASE_S", 2.0)
    topo = Topology(0, 2, 1)
    board = topo.board()
    dying, alive = _dying_decode(topo, tmp_path, 0), _alive_decode(topo, 1)
    sup = Supervisor([dying, alive], topo.load_table(), 0, board)
    sup._start(dying)
    try:
        for _ in range(400):
            sup._tend(0.2)
            if dying.failed is not None:
                break
        assert dying.failed is not None and dying.restarts == supervisor.MAX_CRASHES - 1
        row = next(r for r in topo.load_table().snapshot() if r.worker == (Role.DECODE, 0))
        assert row.state is WorkerState.FAILED
        retry_at = board.retry_at(dying.slot)
        assert time.time() < retry_at <= time.time() + 2.0
        for _ in range(400):  # its back-off runs out: started again (and dies again)
            sup._tend(0.2)
            if dying.restarts >= supervisor.MAX_CRASHES:
                break
        assert dying.restarts == supervisor.MAX_CRASHES and dying.failed is None
        assert board.retry_at(dying.slot) == 0.0
    finally:
        sup.shutdown()


def test_deaths_a_frontend_explains_do_not_make_a_crash_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed by poison requests, each death explained on the board by the
    frontend that ended the request, is restarted every time: never FAILED, and the
    server (its only decode worker) never ends."""
    monkeypatch.setattr(supervisor, "RESTART_BASE_S", 0.01)
    monkeypatch.setattr(supervisor, "EXPLAIN_GRACE_S", 0.05)
    topo = Topology(0, 1, 1)
    frontend_view = FrontendBoard(topo.board_segment.buf, me=0)
    child = _dying_decode(topo, tmp_path, 0)
    sup = Supervisor([child], topo.load_table(), 0, topo.board())
    explain = sup._on_death

    def explained_death(c: Child, code: int) -> None:
        assert c.proc is not None
        frontend_view.explain_deaths([c.proc.pid])  # as the poison accounting would
        explain(c, code)

    monkeypatch.setattr(sup, "_on_death", explained_death)
    sup.start_all()
    try:
        for _ in range(400):
            sup._tend(0.2)  # raises ChildFailed if it counted the deaths
            if child.restarts >= 2 * supervisor.MAX_CRASHES:
                break
        assert child.restarts >= 2 * supervisor.MAX_CRASHES and child.failed is None
    finally:
        sup.shutdown()
