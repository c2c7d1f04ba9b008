"""Who belongs to a cluster: a gateway's settings (``GatewaySpec``), the nodes that joined
the head (``Member``), whether a node may join (``join_refusal``: the same model and a KV
layout whose blocks match) and which of the head's reserved decode indices it gets
(``reserve_for``). Pure functions of their arguments; ``cluster.gateway`` holds the state.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from transport.errors import KVTransferError
from transport.load_table import encode_node
from transport.nixl_agent import check_compatible
from wire.kv_layout import KVLayout
from wire.link_records import Join


class GatewaySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A gateway's settings. ``listen`` is set on the head, ``join`` on a member."""

    log_level: str
    node: str
    cluster_key: str
    listen: str
    join: str
    num_prefill: int  # a decode worker g's load-table slot is num_prefill + g
    decode: list[int]  # head: the reserve for other nodes; member: its own workers
    shape: str  # head: the cluster's shape (JSON) a Welcome carries
    layout: str  # KVLayout.to_json() every decode pool must match
    model: str
    beat_s: float
    silent_after_s: float


@dataclass
class Member:
    """A node that joined the head: its decode indices and link identity."""

    node: str
    decode: list[int]
    identity: bytes = b""
    last_heard: float = 0.0
    silent: bool = False


def join_refusal(join: Join, cfg: GatewaySpec, layout: KVLayout, members: dict[str, Member]) -> str:
    """Why the head refuses ``join`` ("" to admit it): a node name the load table cannot
    hold or that is the head's own (``/health`` names each worker's node by it), another
    model, a KV layout whose blocks differ, a count that changed since the node last
    joined, or no room left in the ``--remote-decode`` reserve."""
    try:
        encode_node(join.node)
    except ValueError as e:
        return str(e)
    if join.node == cfg.node:
        return f"its node name {join.node!r} is the head's own: give it another --node-name"
    if join.model != cfg.model:
        return f"it serves {join.model!r}, this cluster {cfg.model!r}"
    try:
        check_compatible(layout, KVLayout.from_json(join.layout))
    except (KVTransferError, ValueError, TypeError) as e:
        return str(e)
    if join.decode < 1:
        return "it brings no decode worker"
    member = members.get(join.node)
    if member is not None:
        if len(member.decode) != join.decode:
            return f"it joined before with {len(member.decode)} decode workers, now {join.decode}"
        if join.base >= 0 and member.decode[0] != join.base:
            return f"it runs decode workers from {join.base}, this head gave it {member.decode}"
        return ""
    if len(reserve_for(join, cfg, members)) == join.decode:
        return ""
    if join.base >= 0:
        want = list(range(join.base, join.base + join.decode))
        return (
            f"it runs decode workers {want}, which are not free in this head's reserve {cfg.decode}"
        )
    left = len(_free(cfg, members))
    return (
        f"it brings {join.decode} decode workers but only {left} of the head's "
        f"--remote-decode {len(cfg.decode)} are left"
    )


def _free(cfg: GatewaySpec, members: dict[str, Member]) -> list[int]:
    taken = {g for m in members.values() for g in m.decode}
    return [g for g in cfg.decode if g not in taken]


def reserve_for(join: Join, cfg: GatewaySpec, members: dict[str, Member]) -> list[int]:
    """The reserve indices a node that is not a member yet gets: those its workers run
    under already (a join again, ``join.base``) if all are free, else the first free
    ones; fewer than it brings when they are not to be had."""
    free = _free(cfg, members)
    if join.base < 0:
        return free[: join.decode]
    want = list(range(join.base, join.base + join.decode))
    return want if set(want) <= set(free) else []
