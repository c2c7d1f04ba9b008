"""The KV handoff between ``launch --workers`` workers: each is a prefill worker to the
others and a decode worker for them, over the ``shm`` backend.

Every worker's pool is a shared segment (``kv.c{c}``, made by the launcher), which the
other workers map to copy from: a handoff from c to w is what a prefill worker's is to a
decode worker (``prefill/worker.py``, ``decode/worker.py``), on these rings:
    kv.c{c}.c{w}    c -> w    KVTransfer (c prefilled it; w decodes it), AbortRequest
                              (a stop string matched its first token, which c sent)
    rel.c{w}.c{c}   w -> c    KVRelease (w copied, or refused, the blocks c pinned)
Which requests move is the router's choice (the request's ``decode_worker``), by the
workers' roles (``transport/role_table.py``); a worker itself does not know its role.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from colocated.scheduler import ColocatedScheduler, ColocatedStep
from engine.config import EngineConfig
from engine.runner import ModelRunner
from runtime.process import ProcessSpec, Rings
from runtime.worker_io import drain, fail_request, send
from transport.kv import pool_view
from transport.kv_backends import ShmExporter, ShmReceiver
from transport.ring import Ring
from transport.segment import Segment, SegmentSpec
from wire.kv_layout import KVLayout
from wire.records import AbortRequest, KVRelease, KVTransfer
from wire.ring_names import Peer, RingKind
from wire.roles import Role

logger = logging.getLogger(__name__)

_EXPORTS_REMEMBERED = 4096  # recent handoffs' decoders, for stop notices that come late


class Handoff:
    """One worker's ends of the handoff: its shared pool, the others' pools, the rings."""

    def __init__(self, spec: ProcessSpec, rings: Rings, config: EngineConfig) -> None:
        if torch.device(config.device).type != "cpu":
            raise RuntimeError("launch --workers hands KV off on CPU only")
        self._segs: list[Segment] = []
        pools: dict[int, torch.Tensor] = {}
        for name, pool in spec.kv_pools.items():
            seg = Segment.attach(SegmentSpec(f"kv.{name}", pool["fd"], pool["nbytes"]))
            self._segs.append(seg)
            pools[Peer.parse(name).index] = pool_view(seg, KVLayout(**pool["layout"]))
        me = spec.index
        self.own_pool = pools.pop(me)  # this worker's runner computes into it
        self._others = pools
        self.kv_in = rings.sources(RingKind.KV, Role.COLOCATED)
        self.kv_out = rings.sinks(RingKind.KV, Role.COLOCATED)
        self.rel_in = rings.sources(RingKind.REL, Role.COLOCATED)
        self.rel_out = rings.sinks(RingKind.REL, Role.COLOCATED)
        self.exporter: ShmExporter | None = None
        self._decoder_of: OrderedDict[int, int] = OrderedDict()  # rid -> worker, recent

    def receiver(self, runner: ModelRunner) -> ShmReceiver:
        """Copies into ``runner``'s pool from the other workers' shared pools."""
        self.exporter = ShmExporter(runner.kv.tensor)  # the pool itself is shared: no copy
        return ShmReceiver(self._others, runner.kv.tensor)

    def take_inputs(self, sched: ColocatedScheduler) -> None:
        """Handoffs to adopt and releases of what this worker exported."""
        for ring in self.kv_in.values():
            for msg in drain(ring):
                if isinstance(msg, KVTransfer):
                    self.release(sched.decode.offer(msg))
                elif isinstance(msg, AbortRequest):  # after its transfer: the ring is FIFO
                    sched.abort(msg.rid)
        for ring in self.rel_in.values():
            for msg in drain(ring):
                if isinstance(msg, KVRelease):
                    sched.prefill.release(msg.rid)
        # A decoder that died will never release what was pinned for it.
        for w, ring in self.rel_in.items():
            if sched.prefill.pinned.rids_for(w) and not ring.peer_alive():
                logger.warning("worker %d is gone: unpinning the KV handed to it", w)
                sched.prefill.decode_worker_died(w)

    def stopped(self, rid: int) -> None:
        """A detokenizer's stop notice for ``rid``: it reaches this worker, which sent the
        first token; if ``rid`` was handed off, its decoder is told too."""
        w = self._decoder_of.pop(rid, None)
        if w is not None:
            send(self.kv_out[w], AbortRequest(rid=rid))

    def admit(self, sched: ColocatedScheduler) -> None:
        self.release(sched.admit())
        self.release(sched.releases)
        sched.releases = []

    def release(self, releases: list[tuple[int, KVRelease]]) -> None:
        for i, rel in releases:
            send(self.rel_out[i], rel)

    def ship(self, out: ColocatedStep, sched: ColocatedScheduler, tok_out: dict[int, Ring]) -> None:
        """Send this step's handoffs (their first tokens have gone out already)."""
        assert self.exporter is not None
        for w, transfer in out.transfers:
            self.exporter.export(transfer.src_blocks)
            self._decoder_of[transfer.rid] = w
            while len(self._decoder_of) > _EXPORTS_REMEMBERED:
                self._decoder_of.popitem(last=False)
            if w not in self.kv_out or not send(self.kv_out[w], transfer):
                logger.error("rid %d: no way to hand its KV to worker %d", transfer.rid, w)
                sched.prefill.release(transfer.rid)
                position = len(transfer.output_ids)  # resumed elsewhere by the frontend
                fail_request(tok_out, transfer.rid, transfer.detok_shard, position, lost=True)
