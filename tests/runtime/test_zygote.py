"""Children forked by the zygote see what a fresh ``python -m`` child would: their fds at
the numbers named, the environment sent and nothing else, the launcher as their parent,
default signal handling, their own thread count; the launcher reaps them, reads their exit
status and their orphans' too, a child whose pid never reached the launcher leaves, and a
request the zygote cannot carry or a dead zygote is said at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("zygote")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRIVER_ONLY": "set by the driver's parent"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.zygote_driver", str(out), "torch", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), out


def _report(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_a_child_runs_its_module_as_main_with_its_fds_and_environment(
    run: tuple[dict, Path],
) -> None:
    seen, out = run
    child = _report(out, "exit")
    assert child["name"] == "__main__"
    assert child["argv0"].endswith("zygote_child.py")
    assert child["ppid"] == seen["driver"]  # adopted by the launcher, not the zygote's
    # Each fd at its number with its own content, though the zygote received them on the
    # same low numbers in another order.
    assert child["fds"] == {str(fd): str(fd) for fd in seen["fds"]}
    assert child["open_fds"] == sorted([0, 1, 2, *seen["fds"]])
    assert "DRIVER_ONLY" not in child["env"]  # only what was sent
    assert child["env"]["OMP_NUM_THREADS"] == "2"
    assert child["torch_threads"] == 2  # set from its own environment, not the zygote's 1
    assert child["gc_enabled"]
    assert child["sigint_default"] and child["sigterm_default"] and child["blocked"] == []


def test_exit_codes_and_signals_reach_the_launcher(run: tuple[dict, Path]) -> None:
    seen, _ = run
    assert seen["exit_code"] == 7 and seen["wait_again"] == 7
    assert seen["wait_timed_out"]
    assert seen["killed_code"] == -9


def test_orphans_are_reaped_and_known_children_left_to_their_owner(
    run: tuple[dict, Path],
) -> None:
    seen, _ = run
    assert seen["known_code"] == 5
    assert seen["orphan_zombie"]
    assert seen["zombies_after"] == 0


def test_a_child_whose_pid_never_reached_the_launcher_leaves_before_running(
    run: tuple[dict, Path],
) -> None:
    seen, _ = run
    assert seen["lost_code"] == 1
    assert not seen["lost_reported"]  # it never ran its module


def test_a_request_it_cannot_carry_is_refused_and_the_zygote_serves_on(
    run: tuple[dict, Path],
) -> None:
    seen, _ = run
    assert len(seen["refused"]) == 2, seen["refused"]
    assert "fds" in seen["refused"][0] and "too long" in seen["refused"][1]
    assert seen["after_refusals"] == 3


def test_a_dead_zygote_is_reported_not_waited_for(run: tuple[dict, Path]) -> None:
    seen, _ = run
    assert seen["after_death"].startswith("zygote gone") or "exited" in seen["after_death"]
