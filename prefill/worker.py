"""The prefill worker process: ``python -m prefill.worker`` (started by the launcher).

Loop: take requests, aborts and KV releases off the rings -> run one prefill step ->
ship first tokens to detokenizer shards and KV handoffs to decode workers -> publish
load. With nothing to do it sleeps on its doorbell (no CPU while idle).

KV backends (settings ``kv_transfer``): ``shm`` on CPU shares the pool itself; ``shm`` on
a GPU keeps a pool of exactly the launcher's staging mirror's blocks and copies exported
blocks into the mirror; ``cuda_ipc`` sizes the pool from this worker's GPU share and sends
its handle to each decode process before any transfer (transport/kv_handles.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from engine.build import Engine, build_engine
from engine.config import EngineConfig
from prefill.scheduler import PrefillScheduler, PrefillStep
from runtime.worker import Worker
from runtime.worker_io import drain, fail_request, send
from transport.kv import KVExporter, pool_view
from transport.kv_backends import CudaIpcExporter, ShmExporter, register_host_memory
from transport.kv_handles import HandleSender
from transport.load_table import WorkerState
from transport.segment import Segment, SegmentSpec
from transport.worker_load import WorkerLoad
from wire.kv_layout import KVLayout
from wire.records import KVPoolHandle, KVRelease
from wire.ring_names import Peer, RingKind
from wire.roles import Role

logger = logging.getLogger(__name__)
# A step that could run nothing while requests wait (a grammar compiling, no free KV):
# poll, leaving the core to the compile thread and to decode workers.
_STALLED_POLL_S = 0.001
_LIVE = (WorkerState.STARTING, WorkerState.READY)  # a decode process that has reset its rings


class PrefillWorker(Worker):
    role = Role.PREFILL

    def __init__(self) -> None:
        super().__init__()
        config = self.config
        self.handles: HandleSender | None = None
        if self.settings.kv_transfer == "cuda_ipc":
            engine = build_engine(config)  # the pool is sized from this worker's GPU share
            self.exporter: KVExporter = CudaIpcExporter(engine.kv.tensor)
            self.handles, self._handle = HandleSender(), self.exporter.handle()
        else:
            engine = self._shm_engine(config)
        self.remote = set(self.settings.remote_decode)
        self._remote_gen: dict[int, int | None] = {}
        if self.remote:
            self._export_to_nixl(engine)
        self.engine = engine
        self.sched = PrefillScheduler(engine, self.index, config.chunked_prefill_size)
        self.rel_rings = self.rings.sources(RingKind.REL)
        self.kv_out = self.rings.sinks(RingKind.KV)

    def _export_to_nixl(self, engine: Engine) -> None:
        """Decode workers on other hosts read this pool by NIXL: register it and send them
        its handle (local ones keep reading it as before)."""
        from transport.kv_nixl import NixlExporter

        layout = KVLayout(**self.spec.kv_pools[str(Peer(Role.PREFILL, self.index))]["layout"])
        layout = dataclasses.replace(layout, order=engine.runner.backend.kv_order)  # what it writes
        name = f"{self.settings.node}-prefill-{self.index}-{os.getpid()}"
        self.nixl = NixlExporter(engine.kv.tensor, layout, name)
        self.handles, self._handle = HandleSender(), self.nixl.handle()
        logger.info(
            "KV pool registered with NIXL as %s for decode workers %s", name, sorted(self.remote)
        )

    def _shm_engine(self, config: EngineConfig) -> Engine:
        """The pool on CPU is the shared segment; on GPU the segment is its pinned mirror."""
        pool = self.spec.kv_pools[str(Peer(Role.PREFILL, self.index))]
        layout = KVLayout(**pool["layout"])
        self._pool_seg = Segment.attach(
            SegmentSpec(f"kv.p{self.index}", pool["fd"], pool["nbytes"])
        )
        shared = pool_view(self._pool_seg, layout)
        if torch.device(config.device).type == "cpu":
            engine = build_engine(config, kv_pool=shared)
            self.exporter = ShmExporter(engine.kv.tensor)
            return engine
        # NOTE: exactly the mirror's blocks, so a block id means the same in both.
        engine = build_engine(dataclasses.replace(config, num_kv_blocks=layout.num_blocks))
        register_host_memory(shared)
        self.exporter = ShmExporter(engine.kv.tensor, staging=shared)
        return engine

    def step(self) -> bool:
        if self.handles is not None:
            self._send_pool_handle()
        for j, ring in self.rel_rings.items():
            if not ring.peer_alive() and self.sched.pinned.rids_for(j):
                self.sched.decode_worker_died(j)
        out = self.sched.step()
        self._ship(out)
        if self.remote:  # remote decode workers read while blocks are pinned for them
            self.nixl.serve_reads(any(self.sched.pinned.rids_for(j) for j in self.remote))
        if self.sched.waiting and not out.ran_tokens and not out.tokens:
            time.sleep(_STALLED_POLL_S)
        return bool(self.sched.waiting)

    def take_inputs(self) -> None:
        self.take_requests(self.sched)
        for ring in self.rel_rings.values():
            for msg in drain(ring):
                if isinstance(msg, KVRelease):
                    self.sched.release(msg.rid)

    def _send_pool_handle(self) -> None:
        """cuda_ipc (or nixl, to other hosts): every live decode process that maps this pool
        gets its handle before any transfer."""
        assert self.handles is not None
        live = {
            r.index: r.generation
            for r in self.table.snapshot()
            if r.role is Role.DECODE
            and r.state in _LIVE
            and (not self.remote or r.index in self.remote)
        }
        self._forget_lost_remote(live)
        for j in self.handles.due(live):
            if j in self.kv_out:
                send(self.kv_out[j], KVPoolHandle(prefill_worker=self.index, handle=self._handle))
                logger.info("sent the KV pool handle to decode %d", j)

    def _forget_lost_remote(self, live: dict[int, int]) -> None:
        """A decode worker on another host that died or was restarted will not release
        what was pinned for it (its ring's producer here is the gateway, which lives on):
        its load-table row, mirrored by the gateway, says so instead."""
        for j in self.remote:
            gen = live.get(j)
            if gen != self._remote_gen.get(j):
                if self.sched.pinned.rids_for(j):
                    self.sched.decode_worker_died(j)
                self._remote_gen[j] = gen

    def _ship(self, out: PrefillStep) -> None:
        # Tokens first: TTFT never waits for the KV handoff.
        for shard, batch in out.tokens.items():
            send(self.tok_out[shard], batch)
        for j, transfer in out.transfers:
            (self.nixl if j in self.remote else self.exporter).export(transfer.src_blocks)
            if not send(self.kv_out[j], transfer):  # decode j died: resume it elsewhere
                self.sched.release(transfer.rid)
                position = len(transfer.output_ids)  # the first token has gone out
                fail_request(self.tok_out, transfer.rid, transfer.detok_shard, position, lost=True)

    def load(self) -> WorkerLoad:
        return self.sched.load()


def main() -> None:
    PrefillWorker().run()


if __name__ == "__main__":
    main()
