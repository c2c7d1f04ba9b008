"""Every shared resource of one server, created by the launcher before any child starts.

The launcher creates all rings, doorbells, the load table, the frontends' board
(``frontend/engine_link/board.py``), the prefill KV pools and the engine workers' prefix
summaries (``add_prefix_summaries``), then
hands each child the fds it needs (``subprocess.Popen(pass_fds=...)``) and a JSON
``ProcessSpec`` naming them. Segment names are unlinked the moment they are created, so
nothing of ours is ever visible in /dev/shm, and a restarted child attaches to the very
same memory through the same inherited fds.

Ring names and what each carries: ``wire/ring_names.py``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from frontend.engine_link import lora_table
from frontend.engine_link.board import FrontendBoard
from runtime.process import ProcessSpec
from transport.doorbell import Doorbell
from transport.kv import create_pool_segment
from transport.load_table import LoadTable
from transport.prefix_summary import PrefixSummary, create_summary_segment
from transport.ring import Ring
from transport.role_table import RoleTable
from transport.segment import Segment
from wire.kv_layout import KVLayout
from wire.ring_names import Peer, RingKind, RingName
from wire.roles import Role

logger = logging.getLogger(__name__)

MiB = 1 << 20
# Capacities: a request ring holds long prompts; token rings a few steps of a full batch
# with top-20 logprobs (~46 KB per 256-request step); control rings small records.
RING_BYTES = {
    RingKind.REQ: 8 * MiB,
    RingKind.KV: 4 * MiB,
    RingKind.TOK: 4 * MiB,
    RingKind.TEXT: 8 * MiB,
}
SMALL_RING_BYTES = 256 * 1024


class Topology:
    """Creates and owns (keeps open) every ring, doorbell and segment of a server.

    On a node of a cluster (``docs/multi_host.md``) the numbering is the cluster's, and
    ``remote`` names the peers that live on other hosts: this node's gateway
    (``cluster/gateway.py``) is the local end of every ring that has one of them at the
    other end, so rings stay single-producer, single-consumer and local. Only the rings
    with at least one local end are created; a remote peer has no doorbell here.
    """

    GATEWAY = Peer(Role.GATEWAY, 0)

    def __init__(
        self,
        num_prefill: int,
        num_decode: int,
        num_detok: int,
        num_colocated: int = 0,
        num_frontends: int = 1,
        remote: frozenset[Peer] = frozenset(),
        handoff: bool = False,
    ) -> None:
        """``handoff``: the co-located workers also hand KV to each other (``--workers``)."""
        self.p, self.d, self.k, self.c = num_prefill, num_decode, num_detok, num_colocated
        self.handoff = handoff
        self.f = num_frontends
        self.remote = remote
        self.frontends = [Peer(Role.FRONTEND, n) for n in range(self.f)]
        peers = [*self.frontends] + [Peer(Role.PREFILL, i) for i in range(self.p)]
        peers += [Peer(Role.DECODE, j) for j in range(self.d)]
        peers += [Peer(Role.DETOK, k) for k in range(self.k)]
        peers += [Peer(Role.COLOCATED, c) for c in range(self.c)]
        peers = [p for p in peers if p not in remote]
        if remote:
            peers.append(self.GATEWAY)
        self.doorbells = {peer: Doorbell.create() for peer in peers}
        self.rings: dict[RingName, Ring] = {}
        self._build_rings()
        self.num_workers = self.p + self.d + self.c
        nbytes = LoadTable.layout_nbytes(self.num_workers)
        self.load_segment = Segment.create("load", nbytes)
        LoadTable(self.load_segment.buf, self.num_workers)  # writes the header
        nbytes = FrontendBoard.layout_nbytes(self.f, self.k, self.num_workers)
        self.board_segment = Segment.create("frontends", nbytes)
        FrontendBoard.format(self.board_segment.buf, self.f, self.k, self.num_workers)
        self.kv_segments: dict[str, tuple[Segment, KVLayout]] = {}
        self.summary_segments: dict[str, Segment] = {}
        # The host's KV tier 2 (launcher/kv_tiers.py): engine workers store and load
        # blocks there, frontends read its counters; the fields go in each EngineConfig.
        self.kv_tier: Segment | None = None
        self.kv_tier_fields: dict[str, Any] = {}
        self.kv_tier_frontend: dict[str, Any] = {}
        # The host's weights segment (engine/checkpoint/shared_weights.py): an empty memfd
        # the first CPU engine worker fills; every engine worker inherits it.
        self.weights_fd: int | None = None
        # The LoRA adapters every frontend serves (``--enable-lora``): one shared list.
        self.lora_segment: Segment | None = None
        # ``--workers``: every worker's role (transport/role_table.py), for the frontends.
        self.roles_segment: Segment | None = None
        if handoff:
            self.roles_segment = Segment.create("roles", RoleTable.layout_nbytes(self.c, self.f))
            RoleTable.format(self.roles_segment.buf, self.c, self.f)

    def add_lora_table(self, max_loras: int) -> None:
        self.lora_segment = Segment.create("loras", lora_table.layout_nbytes(max_loras))
        lora_table.format_table(self.lora_segment.buf)

    def _add(self, kind: RingKind, src: Peer, dst: Peer) -> None:
        if src in self.remote and dst in self.remote:
            return  # between two other hosts: not this node's ring
        name = RingName(kind, src, dst)
        capacity = RING_BYTES.get(kind, SMALL_RING_BYTES)
        bell = self.doorbells[self.GATEWAY if dst in self.remote else dst]
        self.rings[name] = Ring.create(str(name), capacity, bell)

    def _add_streams(self, worker: Peer, shards: list[Peer]) -> None:
        """A decoding worker's token rings: TOK to each detokenizer shard, STOP back."""
        for k in shards:
            self._add(RingKind.TOK, worker, k)
            self._add(RingKind.STOP, k, worker)

    def local(self, peer: Peer) -> bool:
        return peer not in self.remote

    def _build_rings(self) -> None:
        """Every ring of ``wire/ring_names.py``; each frontend has its own to every peer."""
        shards = [Peer(Role.DETOK, k) for k in range(self.k)]
        for i in range(self.p):
            p = Peer(Role.PREFILL, i)
            for f in self.frontends:
                self._add(RingKind.REQ, f, p)
            for k in shards:
                self._add(RingKind.TOK, p, k)
            for j in range(self.d):
                d = Peer(Role.DECODE, j)
                self._add(RingKind.KV, p, d)
                self._add(RingKind.REL, d, p)
        for j in range(self.d):
            d = Peer(Role.DECODE, j)
            for f in self.frontends:
                self._add(RingKind.CTL, f, d)
            self._add_streams(d, shards)
        for c in range(self.c):
            w = Peer(Role.COLOCATED, c)
            for f in self.frontends:
                self._add(RingKind.REQ, f, w)
            self._add_streams(w, shards)
            for other in range(self.c) if self.handoff else ():
                if other != c:  # c prefills, other decodes (transport/role_table.py)
                    self._add(RingKind.KV, w, Peer(Role.COLOCATED, other))
                    self._add(RingKind.REL, Peer(Role.COLOCATED, other), w)
        for k in shards:
            for f in self.frontends:
                self._add(RingKind.CTL, f, k)
                self._add(RingKind.TEXT, k, f)

    def add_kv_pool(self, prefill: int, layout: KVLayout, role: Role = Role.PREFILL) -> None:
        """The shared segment decode workers copy prefill ``prefill``'s blocks from (or
        the other ``--workers`` workers, co-located worker ``prefill``'s)."""
        name = str(Peer(role, prefill))
        self.kv_segments[name] = (create_pool_segment(name, layout), layout)

    def add_kv_tier(
        self,
        segment: Segment,
        engine_fields: dict[str, Any],
        frontend_fields: dict[str, Any] | None = None,
    ) -> None:
        self.kv_tier, self.kv_tier_fields = segment, engine_fields
        self.kv_tier_frontend = frontend_fields or {}

    def add_weights(self) -> None:
        """One copy of the read-only weights for this host's CPU engine workers (where
        the OS has sealable memfds; elsewhere each worker loads its own)."""
        from engine.checkpoint.weights_segment import SharedWeightsError, create_segment

        try:
            self.weights_fd = create_segment()
        except SharedWeightsError as e:
            logger.warning("each worker loads its own weights: %s", e)

    def add_prefix_summaries(self, num_counters: int) -> None:
        """One summary segment per engine worker: it writes its own, the frontend reads all."""
        workers = [Peer(Role.PREFILL, i) for i in range(self.p)]
        workers += [Peer(Role.DECODE, j) for j in range(self.d)]
        workers += [Peer(Role.COLOCATED, c) for c in range(self.c)]
        # A remote worker's summary lives on its own host; only a frontend would read it,
        # and a member node has none.
        frontend_here = any(self.local(f) for f in self.frontends)
        for w in (w for w in workers if frontend_here or self.local(w)):
            # A remote worker's summary stays empty on the head: the router then counts
            # no cached prefix for it (its load still routes it).
            seg = self.summary_segments[str(w)] = create_summary_segment(str(w), num_counters)
            PrefixSummary(seg.buf, num_counters)  # writes the header

    def gateway_spec(self, settings: dict[str, Any]) -> ProcessSpec:
        """The gateway's spec: every ring with a remote end, and the whole load table (it
        writes the remote workers' rows and reads the local ones)."""
        me = self.GATEWAY
        return ProcessSpec(
            role=Role.GATEWAY,
            index=0,
            doorbell_fd=self.doorbells[me].fd,
            rings_in={
                str(n): asdict(r.spec) for n, r in self.rings.items() if n.dst in self.remote
            },
            rings_out={
                str(n): asdict(r.spec) for n, r in self.rings.items() if n.src in self.remote
            },
            load_table={
                "fd": self.load_segment.spec.fd,
                "nbytes": self.load_segment.spec.nbytes,
                "num_workers": self.num_workers,
                "slot": -1,
            },
            settings=settings,
        )

    def spec(self, role: Role, index: int, settings: dict[str, Any]) -> ProcessSpec:
        me = Peer(role, index)
        board = self.board_segment.spec
        segments = {"frontends": {"fd": board.fd, "nbytes": board.nbytes}}
        segments = segments if role is Role.FRONTEND else {}
        if self.lora_segment is not None and role is Role.FRONTEND:
            lora = self.lora_segment.spec
            segments["loras"] = {"fd": lora.fd, "nbytes": lora.nbytes}
        if self.roles_segment is not None and role is Role.FRONTEND:
            roles = self.roles_segment.spec
            segments["roles"] = {"fd": roles.fd, "nbytes": roles.nbytes}
        if self.kv_tier is not None and (role.is_engine or role is Role.FRONTEND):
            segments["kvtier"] = {"fd": self.kv_tier.spec.fd, "nbytes": self.kv_tier.spec.nbytes}
            if role is Role.FRONTEND:  # what its router needs (router/tier_residency.py)
                segments["kvtier"].update(self.kv_tier_frontend)
        if self.weights_fd is not None and role.is_engine:
            segments["weights"] = {"fd": self.weights_fd, "nbytes": 0}  # sized by its writer
        # Slots: prefill workers, then decode workers; a colocated server has only c rows.
        slot = {Role.PREFILL: index, Role.DECODE: self.p + index, Role.COLOCATED: index}.get(
            role, -1
        )
        kv_pools = {
            name: {"fd": seg.spec.fd, "nbytes": seg.spec.nbytes, "layout": asdict(layout)}
            for name, (seg, layout) in self.kv_segments.items()
            if name == str(me) or role in (Role.DECODE, Role.COLOCATED)
        }
        return ProcessSpec(
            role=role,
            index=index,
            doorbell_fd=self.doorbells[me].fd,
            rings_in={str(n): asdict(r.spec) for n, r in self.rings.items() if n.dst == me},
            rings_out={str(n): asdict(r.spec) for n, r in self.rings.items() if n.src == me},
            load_table={
                "fd": self.load_segment.spec.fd,
                "nbytes": self.load_segment.spec.nbytes,
                "num_workers": self.num_workers,
                "slot": slot,
            },
            kv_pools=kv_pools,
            settings=settings,
            prefix_summaries={
                name: {"fd": seg.spec.fd, "nbytes": seg.spec.nbytes}
                for name, seg in self.summary_segments.items()
                if name == str(me) or role is Role.FRONTEND
            },
            segments=segments,
        )

    def load_table(self) -> LoadTable:
        return LoadTable(self.load_segment.buf, self.num_workers)

    def board(self) -> FrontendBoard:
        """The launcher's view of the frontends' board (no row of its own)."""
        return FrontendBoard(self.board_segment.buf)
