"""A frontend's part in ``launch --workers``: the role table, the planner, the samples.

Every frontend reads the roles (its router places by them) and shows them in /health
and /metrics. Frontend 0 also runs the planner (``router/planner.py``): it feeds it
each finished request's TTFT and TPOT (``observe``) and steps it every
``PlannerConfig.interval_s`` over the load table (``run``). POST /roles
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
        self.table = table
        self.allow_override = allow_override
        self.planner: Planner | None = None
        if owner == 0 and slo_ms is not None:
            ttft, tpot = slo_ms
            self.planner = Planner(table, PlannerConfig(ttft / 1e3, tpot / 1e3))
            logger.info("planner on: TTFT target %.0f ms, TPOT target %.0f ms", ttft, tpot)

    def observe(self, arrived: float, first_at: float | None, tokens: int) -> None:
        """A request that arrived at ``arrived`` (monotonic s) finished now with ``tokens``
        output tokens, the first at ``first_at``."""
        if self.planner is None or first_at is None:
            return
        now = time.monotonic()
        tpot = (now - first_at) / (tokens - 1) if tokens > 1 else None
        self.planner.observe(Sample(arrived, first_at - arrived, tpot))

    async def run(self, load: LoadTable) -> None:
        """Step the planner until cancelled (frontend 0 only)."""
        assert self.planner is not None
        while True:
            await asyncio.sleep(self.planner.config.interval_s)
            try:
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
