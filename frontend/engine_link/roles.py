"""A frontend's part in ``launch --workers``: the role table, the planner, the samples.

Every frontend reads the roles (its router places by them) and shows them in /health
and /metrics, and writes each finished request's TTFT and TPOT to its own ring of the
role table (``observe``). Frontend 0 also runs the planner (``router/planner.py``):
every ``PlannerConfig.interval_s`` it feeds it what every frontend's ring gained and
steps it over the load table (``run``). POST /roles
(``frontend/http/roles_route.py``), when the launch allows it, sets roles by hand and
stops the planner for good: a test's or an experiment's roles stay as set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from router.planner import Planner, PlannerConfig, Sample
from transport.load_table import LoadTable
from transport.role_table import SERVING_ROLES, RoleTable
from wire.roles import Role

logger = logging.getLogger(__name__)


class RoleError(ValueError):
    """Roles asked by hand that cannot be served (the route answers 400 with it)."""


class RoleControl:
    def __init__(
        self,
        table: RoleTable,
        owner: int,
        slo_ms: tuple[float, float] | None,
        allow_override: bool,
    ) -> None:
        self.table, self.owner = table, owner
        self.allow_override = allow_override
        self.sampling = slo_ms is not None  # a planner runs (in frontend 0)
        self.planner: Planner | None = None
        # Samples taken from each frontend's ring: from now (a restarted frontend 0's
        # planner starts afresh, as its first did).
        self._seen = [table.sample_count(f) for f in range(table.num_frontends)]
        if owner == 0 and slo_ms is not None:
            ttft, tpot = slo_ms
            self.planner = Planner(table, PlannerConfig(ttft / 1e3, tpot / 1e3))
            logger.info("planner on: TTFT target %.0f ms, TPOT target %.0f ms", ttft, tpot)

    def observe(self, arrived: float, first_at: float | None, tokens: int) -> None:
        """A request that arrived at ``arrived`` (monotonic s) finished now with ``tokens``
        output tokens, the first at ``first_at``."""
        if not self.sampling or first_at is None:
            return
        now = time.monotonic()
        tpot = (now - first_at) / (tokens - 1) if tokens > 1 else None
        self.table.add_sample(self.owner, arrived, first_at - arrived, tpot)

    def take_samples(self) -> int:
        """Feed the planner what every frontend finished since the last call; how many."""
        assert self.planner is not None
        taken = 0
        for f in range(self.table.num_frontends):
            samples, self._seen[f] = self.table.samples_since(f, self._seen[f])
            for arrived, ttft, tpot in samples:
                self.planner.observe(Sample(arrived, ttft, tpot))
            taken += len(samples)
        return taken

    async def run(self, load: LoadTable) -> None:
        """Step the planner until cancelled (frontend 0 only)."""
        assert self.planner is not None
        while True:
            await asyncio.sleep(self.planner.config.interval_s)
            try:
                self.take_samples()
                self.planner.step(load.snapshot())
            except Exception:  # the planner must outlive any one bad step
                logger.exception("planner step failed")

    def serving_roles(self) -> dict[int, str]:
        """Each worker's role now (/health), by worker index."""
        return {i: role.value for i, role in enumerate(self.table.roles())}

    def set_by_hand(self, names: Sequence[str]) -> list[Role]:
        """Set every worker's role from ``names`` (by worker index) and stop the planner;
        ``RoleError`` if they are not one serving role per worker, with at least one
        worker taking new requests and one decoding."""
        n = self.table.num_workers
        allowed = {r.value: r for r in SERVING_ROLES}
        if len(names) != n or any(name not in allowed for name in names):
            raise RoleError(f"give {n} roles, one per worker, each one of {sorted(allowed)}")
        roles = [allowed[name] for name in names]
        if all(r is Role.DECODE for r in roles) or all(r is Role.PREFILL for r in roles):
            raise RoleError("at least one worker must take new requests and one decode")
        self.table.mark_by_hand()  # every frontend's planner keeps off from now on
        for i, (old, role) in enumerate(zip(self.table.roles(), roles, strict=True)):
            if self.table.set(i, role):
                logger.info("worker %d: role %s -> %s (set by hand)", i, old.value, role.value)
        return roles
