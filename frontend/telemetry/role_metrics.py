"""``launch --workers`` in /metrics: each worker's role, its role changes and the time it
spent in each role (``transport/role_table.py``), and how requests were placed by
role (``router/roles.py``), every frontend's placements summed."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from transport.role_table import RoleTable


class RoleCollector(Collector):
    def __init__(self, table: RoleTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        role = GaugeMetricFamily(
            "pdserve_worker_role",
            "1 for the role a --workers worker serves as now (prefill, decode, colocated)",
            labels=["index", "role"],
        )
        changes = CounterMetricFamily(
            "pdserve_worker_role_changes", "Role changes of a --workers worker", labels=["index"]
        )
        seconds = CounterMetricFamily(
            "pdserve_worker_role_seconds",
            "Seconds a --workers worker has served in each role",
            labels=["index", "role"],
        )
        for w in self._table.report():
            changes.add_metric([str(w.index)], w.changes)
            for r, s in w.seconds.items():
                role.add_metric([str(w.index), r.value], 1.0 if r is w.role else 0.0)
                seconds.add_metric([str(w.index), r.value], s)
        placed = CounterMetricFamily(
            "pdserve_placements",
            "Requests placed among --workers workers: handoff (prefill worker -> decode "
            "worker), local (whole on a decode worker: no handoff), colocated (whole on a "
            "co-located worker)",
            labels=["kind"],
        )
        for kind, n in self._table.placements().items():
            placed.add_metric([kind], n)
        yield from (role, changes, seconds, placed)
