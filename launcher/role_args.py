"""The flags of roles the server chooses (docs/roles.md), kept apart from
``launcher/flags.py``'s long table: ``--workers N``, ``--slo-ttft-ms``, ``--slo-tpot-ms``
and ``--allow-role-override`` (tests and experiments only).

``--workers N`` starts N engine workers of one kind whose roles (prefill, decode, or
both) the planner (``router/planner.py``) sets and changes while serving. Inside the
launcher it is ``--colocated N`` with a KV handoff between the workers (every pool in
shared memory, rings between every pair) and a role table (``transport/role_table.py``).
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol

from router.planner import DEFAULT_SLO_MS

DEFAULTS: dict[str, Any] = {
    "workers": 0,
    "slo_ttft_ms": None,
    "slo_tpot_ms": None,
    "allow_role_override": False,
}


class RoleFlags(Protocol):
    """The role fields of ``ServerConfig`` (read only)."""

    @property
    def workers(self) -> int: ...
    @property
    def slo_ttft_ms(self) -> float | None: ...
    @property
    def slo_tpot_ms(self) -> float | None: ...
    @property
    def colocated(self) -> int: ...
    @property
    def prefill(self) -> int: ...
    @property
    def decode(self) -> int: ...
    @property
    def allow_role_override(self) -> bool: ...


def add_role_flags(p: argparse._ActionsContainer) -> None:
    add = p.add_argument
    add(
        "--workers",
        type=int,
        default=DEFAULTS["workers"],
        help="run this many engine workers whose roles (prefill, decode, or both) the "
        "server sets and changes while serving, against --slo-ttft-ms and --slo-tpot-ms; "
        "instead of --prefill/--decode or --colocated (CPU only for now)",
    )
    cpu_ttft, cpu_tpot = DEFAULT_SLO_MS["cpu"]
    gpu_ttft, gpu_tpot = DEFAULT_SLO_MS["cuda"]
    add(
        "--slo-ttft-ms",
        type=float,
        default=DEFAULTS["slo_ttft_ms"],
        help=f"--workers: the time-to-first-token target the planner holds (default "
        f"{cpu_ttft:.0f} on CPU, {gpu_ttft:.0f} on a GPU)",
    )
    add(
        "--slo-tpot-ms",
        type=float,
        default=DEFAULTS["slo_tpot_ms"],
        help=f"--workers: the time-per-output-token target the planner holds (default "
        f"{cpu_tpot:.0f} on CPU, {gpu_tpot:.0f} on a GPU)",
    )
    add(
        "--allow-role-override",
        action="store_true",
        default=DEFAULTS["allow_role_override"],
        help="--workers: accept POST /roles, which sets the workers' roles by hand and "
        "stops the planner (for tests and experiments; off, the route answers 404)",
    )


def validate_role_flags(c: RoleFlags, defaults: RoleFlags) -> str | None:
    """What is wrong with the role flags, in words naming the flag; None if nothing."""
    if c.workers < 0:
        return f"--workers must be >= 0, got {c.workers}"
    for flag, ms in (("--slo-ttft-ms", c.slo_ttft_ms), ("--slo-tpot-ms", c.slo_tpot_ms)):
        if ms is not None and not ms > 0:
            return f"{flag} must be a positive number of milliseconds, got {ms}"
    if c.workers == 0:
        if c.slo_ttft_ms is not None or c.slo_tpot_ms is not None:
            return "--slo-ttft-ms/--slo-tpot-ms steer --workers' planner: add --workers N"
        if c.allow_role_override:
            return "--allow-role-override sets the roles of --workers N: add --workers N"
        return None
    if c.colocated not in (0, c.workers):  # parse_args makes it c.workers
        return "--workers replaces --colocated: give one of them"
    if (c.prefill, c.decode) != (defaults.prefill, defaults.decode):
        return "--workers sets roles itself: drop --prefill/--decode"
    return None


def slo_targets(c: RoleFlags, device: str) -> tuple[float, float]:
    """(TTFT, TPOT) targets in milliseconds: the flags', else the device's defaults."""
    ttft, tpot = DEFAULT_SLO_MS["cuda" if device == "cuda" else "cpu"]
    return c.slo_ttft_ms or ttft, c.slo_tpot_ms or tpot
