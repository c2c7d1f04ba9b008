"""Children forked by the zygote see what a fresh ``python -m`` child would: their fds at
the numbers named, the environment sent and nothing else, the launcher as their parent,
their own thread count; the launcher reaps them, reads their exit status and their
orphans' too, and learns at once when the zygote cannot fork."""

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
        timeout=120,
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
    assert child["fds"] == {"9": "first", "8": "second", "41": "third"}
    assert child["open_fds"] == [0, 1, 2, 8, 9, 41]
    assert "DRIVER_ONLY" not in child["env"]  # only what was sent
    assert child["env"]["OMP_NUM_THREADS"] == "2"
    assert child["torch_threads"] == 2  # set from its own environment, not the zygote's 1
    assert child["gc_enabled"]


def test_exit_codes_and_signals_reach_the_launcher(run: tuple[dict, Path]) -> None:
    seen, _ = run
    assert seen["exit_code"] == 7
    assert seen["wait_timed_out"]
    assert seen["killed_code"] == -9


def test_a_dead_childs_orphans_are_reaped(run: tuple[dict, Path]) -> None:
    seen, _ = run
    assert seen["zombies_before"] == 1
    assert seen["zombies_after"] == 0


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
