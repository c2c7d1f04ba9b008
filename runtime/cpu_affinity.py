"""Which cores a CPU host's children run on (``launch --cpu-affinity``, docs/colocated.md).

An engine worker's step is a chain of short OpenMP regions (a one-row decode step of the
default model: ~200 of them, ~20 us each), driven by the worker's main thread, which
also runs the Python between them. When the detokenizer or the frontend wakes (once a
token at one stream) on the core that thread holds, the whole chain stops until it is
done; on another core it only delays one pool thread's share. So where a host has more
cores than CPU engine workers, the launcher gives each engine worker a home core for its
main thread, and keeps the detokenizer shards and HTTP frontends on the cores left. The
OpenMP pool threads keep every core: a step still runs on all of them.

The launcher passes the choice in the environment: ``PDSERVE_HOME_CORE`` (an engine
worker) and ``PDSERVE_CPUS`` (a detokenizer shard or frontend). A child without them
runs where the scheduler puts it, as everywhere when ``--cpu-affinity off``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

HOME_ENV = "PDSERVE_HOME_CORE"
CPUS_ENV = "PDSERVE_CPUS"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPlan:
    """``homes[i]``: the core of the i-th CPU engine worker's main thread; ``rest``: the
    cores of the detokenizer shards and frontends."""

    homes: tuple[int, ...]
    rest: tuple[int, ...]

    def home_env(self, worker: int) -> dict[str, str]:
        return {HOME_ENV: str(self.homes[worker % len(self.homes)])}

    def rest_env(self) -> dict[str, str]:
        return {CPUS_ENV: ",".join(map(str, self.rest))}


def plan_cpus(cores: Sequence[int], engines: int) -> CpuPlan | None:
    """The plan for ``engines`` CPU engine workers on ``cores`` (the launcher's affinity),
    or None where no core would be left for the rest (then nothing is pinned)."""
    cores = sorted(cores)
    if engines < 1 or len(cores) <= engines:
        return None
    return CpuPlan(tuple(cores[:engines]), tuple(cores[engines:]))


def _cores(text: str) -> set[int]:
    return {int(part) for part in text.split(",") if part.strip()}


def keep_to_env_cpus() -> None:
    """A detokenizer shard or frontend, first thing (before it starts threads, which
    inherit the mask): run on ``PDSERVE_CPUS`` if the launcher set it."""
    text = os.environ.get(CPUS_ENV, "")
    if text:
        _set_affinity(_cores(text))


def keep_main_thread_home(pool_threads: int) -> None:
    """An engine worker, once its engine is built: start OpenMP's pool at ``pool_threads``
    threads (new pool threads would inherit the main thread's single core, so all are
    made first, on every core), then keep the calling (main) thread to
    ``PDSERVE_HOME_CORE`` if the launcher set it. The thread count is left as it was."""
    text = os.environ.get(HOME_ENV, "")
    if not text:
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(pool_threads)
    # A reduction long enough that every thread gets a share: each starts the pool.
    torch.ones(pool_threads * (1 << 16)).sum()
    torch.set_num_threads(threads)
    _set_affinity(_cores(text))


def _set_affinity(cores: set[int]) -> None:
    """The calling thread onto ``cores``; a mask the kernel refuses (a core offline, or
    outside a cgroup's cpuset) is logged and leaves the thread where it was."""
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, ValueError) as e:
        logger.warning("could not keep to cores %s (%s): left to the scheduler", cores, e)
