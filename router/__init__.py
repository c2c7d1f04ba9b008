"""Request placement: the shared-memory load table and the routing policies."""

from __future__ import annotations

from router.load_table import LoadTable, Role, RowWriter, WorkerLoad, WorkerState
from router.policy import NoCapacity, Placement, PolicyName, Router, RouterConfig

__all__ = [
    "LoadTable",
    "NoCapacity",
    "Placement",
    "PolicyName",
    "Role",
    "Router",
    "RouterConfig",
    "RowWriter",
    "WorkerLoad",
    "WorkerState",
]
