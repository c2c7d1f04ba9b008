"""Which cores a CPU host's children run on (``launch --cpu-affinity``).

An engine worker's step is a chain of short OpenMP regions (a one-row decode step of the
default model: ~200 of them, ~20 us each), driven by the worker's main thread, which
also runs the Python between them. When the detokenizer or the frontend wakes (once a
token at one stream) on the core that thread holds, the whole chain stops until it is
done; a pool thread that the scheduler moved onto that core slows it. So where a host
has more cores than CPU engine workers, the launcher gives each engine worker a home
core for its main thread, and keeps the detokenizer shards and HTTP frontends on the
cores left. A lone engine worker's OpenMP threads are bound one to a core, from its home
on (so the pool still runs on every core); several engine workers lease the cores
between them per step (transport/core_lease.py), so theirs stay free.

The launcher passes the choice in the environment: ``PDSERVE_THREAD_CORES`` (an engine
worker: its main thread's core, then, where given, team thread 1's, 2's, ...) and
``PDSERVE_CPUS`` (a detokenizer shard or frontend). A child without them runs where the
scheduler puts it, as everything does with ``--cpu-affinity off``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

THREADS_ENV = "PDSERVE_THREAD_CORES"
CPUS_ENV = "PDSERVE_CPUS"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPlan:
    """``homes[i]``: the core of the i-th CPU engine worker's main thread; ``rest``: the
    cores of the detokenizer shards and frontends."""

    homes: tuple[int, ...]
    rest: tuple[int, ...]

    def engine_env(self, worker: int) -> dict[str, str]:
        """Worker ``worker``'s threads: a lone worker's team over every core, its home
        first; one of several, its main thread only."""
        home = self.homes[worker % len(self.homes)]
        team = (home, *self.rest) if len(self.homes) == 1 else (home,)
        return {THREADS_ENV: ",".join(map(str, team))}

    def rest_env(self) -> dict[str, str]:
        return {CPUS_ENV: ",".join(map(str, self.rest))}


def plan_cpus(cores: Sequence[int], engines: int) -> CpuPlan | None:
    """The plan for ``engines`` CPU engine workers on ``cores`` (the launcher's affinity),
    or None where no core would be left for the rest (then nothing is pinned)."""
    cores = sorted(cores)
    if engines < 1 or len(cores) <= engines:
        return None
    return CpuPlan(tuple(cores[:engines]), tuple(cores[engines:]))


def _cores(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def keep_to_env_cpus() -> None:
    """A detokenizer shard or frontend, first thing (before it starts threads, which
    inherit the mask): run on ``PDSERVE_CPUS`` if the launcher set it."""
    text = os.environ.get(CPUS_ENV, "")
    if text:
        _set_affinity(set(_cores(text)))


def place_engine_threads(pool_threads: int) -> None:
    """An engine worker, once its engine is built, from its main thread: bind team thread
    t to the t-th core of ``PDSERVE_THREAD_CORES`` where it names several (and the
    kernel library runs here), else keep only the main thread to the first. Either way
    OpenMP's pool is made first, at ``pool_threads`` threads: a pool thread made later
    would inherit the main thread's single core. The thread count is left as it was."""
    text = os.environ.get(THREADS_ENV, "")
    if not text:
        return
    import torch

    from engine.kernels.cpu.ops import bind_threads_op

    team = _cores(text)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(pool_threads, len(team)))
    try:
        # A reduction long enough that every thread gets a share: each joins the pool.
        torch.ones(max(pool_threads, len(team)) * (1 << 16)).sum()
        bind = bind_threads_op() if len(team) > 1 else None
        if bind is not None:
            bound = bind(team)
            if bound == len(team):
                return
            logger.warning("%d of %d threads took their cores %s", bound, len(team), team)
        _set_affinity({team[0]})
    finally:
        torch.set_num_threads(threads)


def _set_affinity(cores: set[int]) -> None:
    """The calling thread onto ``cores``; a mask the kernel refuses (a core offline, or
    outside a cgroup's cpuset) is logged and leaves the thread where it was."""
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, ValueError) as e:
        logger.warning("could not keep to cores %s (%s): left to the scheduler", cores, e)
