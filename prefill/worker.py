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

import torch

from engine.config import EngineConfig
from engine.runner import ModelRunner
from pdserve.process import attach_rings, bootstrap, load_table
from pdserve.worker_io import IDLE_WAIT_S, drain, engine_config, fail_request, rings_by_peer, send
from prefill.scheduler import PrefillScheduler, PrefillStep
from router.load_table import Role, WorkerState
from transport.kv import KVExporter, KVLayout, pool_view
from transport.kv_backends import CudaIpcExporter, ShmExporter, register_host_memory
from transport.kv_handles import HandleSender
from transport.records import AbortRequest, Finish, GenerateRequest, KVPoolHandle, KVRelease
from transport.segment import Segment, SegmentSpec

logger = logging.getLogger(__name__)
_LIVE = (WorkerState.STARTING, WorkerState.READY)  # a decode process that has reset its rings


class PrefillWorker:
    def __init__(self) -> None:
        self.spec, self.stopping = bootstrap()
        i = self.index = self.spec.index
        self.rings_in, self.rings_out, self.doorbell = attach_rings(self.spec)
        self._table, self._load_seg = load_table(self.spec)
        self.row = self._table.writer(self.spec.load_table["slot"])
        config = engine_config(self.spec.settings)
        self.row.claim(Role.PREFILL, i, block_size=config.block_size)
        self.handles: HandleSender | None = None
        if self.spec.settings.get("kv_transfer", "shm") == "cuda_ipc":
            runner = ModelRunner(config)  # the pool is sized from this worker's GPU share
            self.exporter: KVExporter = CudaIpcExporter(runner.kv_pool)
            self.handles, self._handle = HandleSender(), self.exporter.handle()
        else:
            runner = self._shm_runner(config)
        self.sched = PrefillScheduler(runner, i, config.chunked_prefill_size)
        self.req_ring = self.rings_in[f"req.p{i}"]
        self.rel_rings = {int(n.split(".")[1][1:]): r for n, r in self.rings_in.items()
                          if n.startswith("rel.")}  # fmt: skip
        self.kv_out = rings_by_peer(self.rings_out, "kv.")
        self.tok_out = rings_by_peer(self.rings_out, "tok.")

    def _shm_runner(self, config: EngineConfig) -> ModelRunner:
        """The pool on CPU is the shared segment; on GPU the segment is its pinned mirror."""
        pool = self.spec.kv_pools[f"p{self.index}"]
        layout = KVLayout(**pool["layout"])
        self._pool_seg = Segment.attach(
            SegmentSpec(f"kv.p{self.index}", pool["fd"], pool["nbytes"])
        )
        shared = pool_view(self._pool_seg, layout)
        if torch.device(config.device).type == "cpu":
            runner = ModelRunner(config, kv_pool=shared)
            self.exporter = ShmExporter(runner.kv_pool)
            return runner
        # NOTE: exactly the mirror's blocks, so a block id means the same in both.
        runner = ModelRunner(dataclasses.replace(config, num_kv_blocks=layout.num_blocks))
        register_host_memory(shared)
        self.exporter = ShmExporter(runner.kv_pool, staging=shared)
        return runner

    def run(self) -> None:
        self.row.set_state(WorkerState.READY)
        logger.info("ready")
        while not self.stopping:
            self._take_inputs()
            if self.handles is not None:
                self._send_pool_handle()
            for j, ring in self.rel_rings.items():
                if not ring.peer_alive() and self.sched.pinned.rids_for(j):
                    self.sched.decode_worker_died(j)
            out = self.sched.step()
            self._ship(out)
            self._publish()
            if not self.sched.waiting:
                self.doorbell.wait(list(self.rings_in.values()), IDLE_WAIT_S)
        self.row.set_state(WorkerState.DRAINING)

    def _take_inputs(self) -> None:
        for msg in drain(self.req_ring):
            if isinstance(msg, GenerateRequest):
                if self.sched.add(msg) == Finish.ERROR:
                    fail_request(self.tok_out, msg.rid, msg.detok_shard, len(msg.output_ids))
            elif isinstance(msg, AbortRequest):
                self.sched.abort(msg.rid)
        for ring in self.rel_rings.values():
            for msg in drain(ring):
                if isinstance(msg, KVRelease):
                    self.sched.release(msg.rid)

    def _send_pool_handle(self) -> None:
        """cuda_ipc: every live decode process gets this pool's handle before any transfer."""
        assert self.handles is not None
        live = {r.index: r.generation for r in self._table.snapshot()
                if r.role is Role.DECODE and r.state in _LIVE}  # fmt: skip
        for j in self.handles.due(live):
            if j in self.kv_out:
                send(self.kv_out[j], KVPoolHandle(prefill_worker=self.index, handle=self._handle))
                logger.info("sent the KV pool handle to decode %d", j)

    def _ship(self, out: PrefillStep) -> None:
        # Tokens first: TTFT never waits for the KV handoff.
        for shard, batch in out.tokens.items():
            send(self.tok_out[shard], batch)
        for j, transfer in out.transfers:
            self.exporter.export(transfer.src_blocks)
            if not send(self.kv_out[j], transfer):
                self.sched.release(transfer.rid)
                position = len(transfer.output_ids)  # the first token has gone out
                fail_request(self.tok_out, transfer.rid, transfer.detok_shard, position)

    def _publish(self) -> None:
        a = self.sched.runner.allocator
        self.row.publish(
            queued_prefill_tokens=self.sched.queued_tokens,
            waiting_requests=self.sched.num_waiting,
            running_requests=0,
            free_kv_blocks=a.num_available,  # cached blocks are evictable: room
            total_kv_blocks=a.num_blocks,
            requests_received=self.sched.requests_received,
            prompt_tokens_received=self.sched.prompt_tokens_received,
        )


def main() -> None:
    PrefillWorker().run()


if __name__ == "__main__":
    main()
