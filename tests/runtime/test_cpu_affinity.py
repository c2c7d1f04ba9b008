"""``runtime/cpu_affinity.py``: the plan, and each child's side of it, in real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.kernels.cpu.ops import bind_threads_op
from runtime.cpu_affinity import CPUS_ENV, THREADS_ENV, CpuPlan, plan_cpus

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to keep apart")


def test_a_lone_engine_binds_its_team_from_the_first_core_and_leaves_the_rest() -> None:
    plan = plan_cpus([3, 0, 2, 1], 1)
    assert plan == CpuPlan(homes=(0,), rest=(1, 2, 3))
    assert plan.engine_env(0) == {THREADS_ENV: "0,1,2,3"}
    assert plan.rest_env() == {CPUS_ENV: "1,2,3"}


def test_each_of_several_engines_keeps_only_its_main_thread_home() -> None:
    plan = plan_cpus(range(16), 2)
    assert plan is not None
    assert [plan.engine_env(i)[THREADS_ENV] for i in range(3)] == ["0", "1", "0"]
    assert plan.rest == tuple(range(2, 16))


@pytest.mark.parametrize(("cores", "engines"), [([0, 1], 2), ([0, 1], 3), ([0], 1), ([0, 1], 0)])
def test_no_plan_where_no_core_is_left(cores: list[int], engines: int) -> None:
    assert plan_cpus(cores, engines) is None


def _child(code: str, env: dict[str, str]) -> dict[str, list[int]]:
    """Run ``code`` (which prints a JSON mask per thread) in a fresh interpreter."""
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout)  # type: ignore[no-any-return]


_MASKS = (
    "import json, os, threading\n"
    "masks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}\n"
    "print(json.dumps({'main': sorted(os.sched_getaffinity(0)), 'all': masks}))\n"
)


@two_cores
def test_a_shard_keeps_to_its_cores_and_so_do_its_threads() -> None:
    code = (
        "import threading, time\n"
        "from runtime.cpu_affinity import keep_to_env_cpus\n"
        "keep_to_env_cpus()\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n" + _MASKS
    )
    got = _child(code, {CPUS_ENV: str(CORES[-1])})
    assert len(got["all"]) == 2
    assert all(mask == [CORES[-1]] for mask in got["all"].values())


_PLACE = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "from runtime.cpu_affinity import place_engine_threads\n"
    "{patch}"
    f"place_engine_threads({len(CORES)})\n"
    "assert torch.get_num_threads() == 1, 'the thread count is left as it was'\n"
    f"torch.set_num_threads({len(CORES)})\n"
    "torch.ones(1 << 22).sum()  # a step on every thread: no new pool thread appears\n"
)


@two_cores
@pytest.mark.skipif(bind_threads_op() is None, reason="the CPU kernel library does not run here")
def test_a_lone_engine_team_is_bound_one_thread_a_core() -> None:
    team = [CORES[0], CORES[1]]
    got = _child(_PLACE.format(patch="") + _MASKS, {THREADS_ENV: f"{team[0]},{team[1]}"})
    assert got["main"] == [team[0]]
    # The pool thread on the second core; threads the process had before keep every core.
    assert [team[1]] in got["all"].values()
    assert set(map(tuple, got["all"].values())) <= {(team[0],), (team[1],), tuple(CORES)}


@two_cores
@pytest.mark.parametrize("without_library", [False, True])
def test_a_main_thread_alone_keeps_home_and_its_pool_every_core(without_library: bool) -> None:
    # One core named (one of several engines), or a team named where the library cannot
    # run (torch's path): only the main thread moves.
    patch = "import engine.kernels.cpu.ops as o; o.bind_threads_op = lambda: None\n"
    cores = ",".join(map(str, CORES)) if without_library else str(CORES[0])
    got = _child(
        _PLACE.format(patch=patch if without_library else "") + _MASKS, {THREADS_ENV: cores}
    )
    assert got["main"] == [CORES[0]]
    pool = [mask for mask in got["all"].values() if mask != [CORES[0]]]
    assert len(pool) >= len(CORES) - 1
    assert all(mask == CORES for mask in pool)


def test_without_the_variables_nothing_moves() -> None:
    code = (
        "from runtime.cpu_affinity import keep_to_env_cpus, place_engine_threads\n"
        "keep_to_env_cpus(); place_engine_threads(2)\n" + _MASKS
    )
    env = {k: v for k, v in os.environ.items() if k not in (THREADS_ENV, CPUS_ENV)}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["main"] == CORES


def test_a_core_the_kernel_refuses_is_logged_and_ignored() -> None:
    code = "from runtime.cpu_affinity import keep_to_env_cpus\nkeep_to_env_cpus()\n" + _MASKS
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, CPUS_ENV: "100000"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["main"] == CORES
    assert "left to the scheduler" in run.stderr
