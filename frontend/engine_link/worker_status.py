"""``/health`` and ``/metrics`` views of a launched server, read from shared state only.

Both are called on the event loop for every probe or scrape: they read the load table and
the text rings' peer pids, never a round trip to a worker.

Each worker is named with its node: an engine worker's row says which (its own claim, or
the head gateway's mirror of a remote worker's row). Detokenizer shards and frontends run
on the frontend's node (``node``), and so does a row that names none (a writer older than
the field, or a row the launcher marked before its worker claimed it). A worker of the
``--remote-decode`` reserve that no node has brought yet (``remote``) has no node: "".
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

from frontend.engine_link.board import FrontendBoard
from frontend.engine_link.engine_client import WorkerHealth, WorkerReport
from transport.load_table import LoadRow, LoadTable, WorkerState, describe_exit
from transport.ring import Ring
from transport.worker_load import LOAD_FIELDS, SPECULATION_FIELDS
from wire.roles import Role


def shards_alive(text_rings: Sequence[Ring]) -> list[bool]:
    """Which detokenizer shards serve. ``peer_alive()`` also refreshes ``peer_pid``, and a
    shard attaches its rings only once its tokenizer is loaded: pid 0 = starting."""
    return [ring.peer_alive() and ring.peer_pid != 0 for ring in text_rings]


def restart_pending(table: LoadTable, text_rings: Sequence[Ring], board: FrontendBoard) -> bool:
    """Is some worker being restarted (dead, or starting again) and not in crash-loop
    back-off? A shard is in back-off while the board names its retry time."""
    if any(r.role is not None and r.state in _RESTARTING for r in table.snapshot()):
        return True
    alive = shards_alive(text_rings)
    return any(not a and board.retry_at(board.num_workers + k) == 0 for k, a in enumerate(alive))


_RESTARTING = (WorkerState.DEAD, WorkerState.STARTING)

# An engine worker's load as /health shows it: its WorkerLoad but for the router's
# in-flight bookkeeping, the reset epoch, and speculation (on /metrics).
_NOT_SHOWN = frozenset(
    {"requests_received", "prompt_tokens_received", "prefix_reset_epoch", *SPECULATION_FIELDS}
)
_LOAD_FIELDS = tuple(f for f in LOAD_FIELDS if f not in _NOT_SHOWN)


def _node_of(
    worker: tuple[Role, int], claimed: str, node: str, remote: Collection[tuple[Role, int]]
) -> str:
    """The node a worker runs on, by the rules of this module's docstring."""
    if claimed:
        return claimed
    return "" if worker in remote else node


def worker_health(
    table: LoadTable,
    expected: Sequence[tuple[Role, int]],
    text_rings: Sequence[Ring],
    active_per_shard: Mapping[int, int],
    stall_report_s: float,
    *,
    node: str,
    remote: Collection[tuple[Role, int]] = (),
    board: FrontendBoard | None = None,
) -> list[WorkerHealth]:
    """Every worker's role, index, pid, liveness, load and node; then every detokenizer
    shard (on ``node``, the frontend's). ``remote``: the reserve other nodes bring.
    ``board``: where the launcher says when a worker in crash-loop back-off is retried.

    ``expected`` lists the engine workers the launch started (the frontend has a ring to
    each): one that has not claimed its load-table row yet is reported ``starting``, so a
    role is never taken as served because none of its workers has shown up. A READY
    worker whose heartbeat is older than ``stall_report_s`` is reported ``stalled`` and
    not alive: stopped, wedged, or in a step that long.
    """
    out = []
    now_ns = time.monotonic_ns()
    rows: dict[tuple[Role, int], LoadRow] = {
        (r.role, r.index): r for r in table.snapshot() if r.role is not None
    }
    for role, index in sorted({*expected, *rows}, key=lambda k: (k[0].sort_key, k[1])):
        r = rows.get((role, index))
        where = _node_of((role, index), "" if r is None else r.node, node, remote)
        if r is None:  # spawned, not yet in the table
            load = dict.fromkeys(_LOAD_FIELDS, 0.0)
            out.append(
                WorkerHealth(role.health_label, index, 0, False, load, "starting", node=where)
            )
            continue
        state = r.state.name.lower()
        if r.state == WorkerState.READY and now_ns - r.heartbeat_ns > stall_report_s * 1e9:
            state = "stalled"
        alive = state == "ready"  # a (re)starting worker is not serving yet
        load = {f: float(getattr(r, f)) for f in _LOAD_FIELDS}
        dead = r.state in (WorkerState.DEAD, WorkerState.FAILED) and r.exit_status != 0
        reason = describe_exit(r.exit_status) if dead else None
        retry = _retry_at(board, r.slot) if r.state == WorkerState.FAILED else None
        out.append(
            WorkerHealth(
                role.health_label,
                r.index,
                r.pid,
                alive,
                load,
                state,
                reason,
                node=where,
                retry_at=retry,
            )
        )
    for k, (ring, alive) in enumerate(zip(text_rings, shards_alive(text_rings), strict=True)):
        load = {"active_requests": float(active_per_shard.get(k, 0))}
        retry = None if alive or board is None else _retry_at(board, board.num_workers + k)
        state = "ready" if alive else "dead" if retry is None else "failed"
        out.append(
            WorkerHealth(
                Role.DETOK.health_label,
                k,
                ring.peer_pid,
                alive,
                load,
                state,
                node=node,
                retry_at=retry,
            )
        )
    return out


def _retry_at(board: FrontendBoard | None, index: int) -> float | None:
    """When the launcher starts worker ``index`` (board numbering) again; None: not in
    back-off (or no board says)."""
    if board is None or not 0 <= index < board.num_workers + board.num_shards:
        return None
    when = board.retry_at(index)
    return when if when > 0 else None


def frontend_health(board: FrontendBoard, *, node: str) -> list[WorkerHealth]:
    """Every frontend process, from the board: alive while READY (the launcher marks a
    reaped one DEAD; a restarted one is STARTING until it serves). All run on ``node``."""
    out = []
    for f in board.frontends():
        load = {"active_requests": float(f.active)}
        alive = f.state == WorkerState.READY
        out.append(
            WorkerHealth(
                Role.FRONTEND.health_label,
                f.index,
                f.pid,
                alive,
                load,
                f.state.name.lower(),
                node=node,
            )
        )
    return out


def worker_metrics(
    table: LoadTable,
    assigned: Mapping[tuple[Role, int], tuple[int, int]],
    *,
    node: str,
    remote: Collection[tuple[Role, int]] = (),
) -> list[WorkerReport]:
    """Per-worker running/waiting requests, KV usage, prefix-cache figures and what the
    router assigned, each with its node (as ``worker_health`` names it)."""
    out = []
    for r in table.snapshot():
        if r.role is None:
            continue
        n, tokens = assigned.get((r.role, r.index), (0, 0))
        where = _node_of(r.worker, r.node, node, remote)
        out.append(WorkerReport(r.role.value, r.index, r, where, n, tokens))
    return out
