"""The decode worker process: ``python -m decode.worker`` (started by the launcher).

Loop: take KV handoffs, aborts (frontend) and stop notices (detokenizer) off the rings ->
admit handoffs that fit (copy KV, release prefill's blocks) -> one decode step for every
running request -> ship tokens to detokenizer shards -> publish load. Sleeps on its
doorbell when nothing runs.

KV backends (settings ``kv_transfer``): ``shm`` copies from each prefill worker's shared
segment (its pool on CPU, its pinned staging mirror on GPU); ``cuda_ipc`` maps each
prefill GPU pool from the handle that arrives on ``kv.p{i}.d{j}`` before any transfer,
and accepts transfers only from pools it has mapped (transport/kv_handles.py).
"""

from __future__ import annotations

import logging

import torch

from decode.scheduler import DecodeScheduler
from engine.runner import ModelRunner
from pdserve.process import attach_rings, bootstrap, load_row
from pdserve.worker_io import (
    IDLE_WAIT_S,
    drain,
    engine_config,
    fail_request,
    rings_by_peer,
    send,
)
from router.load_table import Role, WorkerState
from transport.errors import KVTransferError
from transport.kv import KVLayout, KVReceiver, pool_view
from transport.kv_backends import CudaIpcReceiver, ShmReceiver, register_host_memory
from transport.kv_handles import PoolImports, Verdict
from transport.records import AbortRequest, KVPoolHandle, KVRelease, KVTransfer
from transport.segment import Segment, SegmentSpec

logger = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self) -> None:
        self.spec, self.stopping = bootstrap()
        j = self.index = self.spec.index
        self.rings_in, self.rings_out, self.doorbell = attach_rings(self.spec)
        self.row, self._load_seg = load_row(self.spec)
        config = engine_config(self.spec.settings)
        self.row.claim(Role.DECODE, j, block_size=config.block_size)
        runner = ModelRunner(config)
        self.imports: PoolImports | None = None
        self.receiver: KVReceiver
        if self.spec.settings.get("kv_transfer", "shm") == "cuda_ipc":
            self.imports, self.receiver = PoolImports(), CudaIpcReceiver({}, runner.kv_pool)
        else:
            self.receiver = self._shm_receiver(runner)
        self.sched = DecodeScheduler(runner, self.receiver, config.max_num_seqs)
        self.kv_in = {int(n.split(".")[1][1:]): r for n, r in self.rings_in.items()
                      if n.startswith("kv.")}  # fmt: skip
        self.ctl_in = [r for n, r in self.rings_in.items() if not n.startswith("kv.")]
        self.rel_out = rings_by_peer(self.rings_out, "rel.")
        self.tok_out = rings_by_peer(self.rings_out, "tok.")

    def _shm_receiver(self, runner: ModelRunner) -> ShmReceiver:
        """Map every prefill worker's shared pool (or staging mirror); copies read from it."""
        self._pool_segs: list[Segment] = []
        sources: dict[int, torch.Tensor] = {}
        for name, pool in self.spec.kv_pools.items():
            seg = Segment.attach(SegmentSpec(f"kv.{name}", pool["fd"], pool["nbytes"]))
            self._pool_segs.append(seg)
            sources[int(name[1:])] = pool_view(seg, KVLayout(**pool["layout"]))
            if runner.device.type == "cuda":
                register_host_memory(sources[int(name[1:])])  # host -> GPU copies by DMA
        return ShmReceiver(sources, runner.kv_pool)

    def run(self) -> None:
        self.row.set_state(WorkerState.READY)
        logger.info("ready")
        while not self.stopping:
            self._take_inputs()
            if self.imports is not None:
                self._unmap_dead_pools()
            self._release(self.sched.admit())
            out = self.sched.step()
            for shard, batch in out.tokens.items():
                send(self.tok_out[shard], batch)
            self._publish()
            if not self.sched.running:
                self.doorbell.wait(list(self.rings_in.values()), IDLE_WAIT_S)
        self.row.set_state(WorkerState.DRAINING)

    def _take_inputs(self) -> None:
        for ring in self.ctl_in:
            for msg in drain(ring):
                if isinstance(msg, AbortRequest):
                    self._release(self.sched.abort(msg.rid))
        for ring in self.kv_in.values():
            for msg in drain(ring):
                if isinstance(msg, KVTransfer):
                    self._offer(msg)
                elif isinstance(msg, KVPoolHandle):
                    self._map_pool(msg)

    def _offer(self, t: KVTransfer) -> None:
        verdict = Verdict.ACCEPT if self.imports is None else self.imports.verdict(t.prefill_worker)
        if verdict is Verdict.ACCEPT:
            self._release(self.sched.offer(t))
        elif verdict is Verdict.DROP:  # the frontend resumes it: prefill i has died
            logger.info("rid %d: dropped, its prefill worker %d died", t.rid, t.prefill_worker)
        else:
            logger.error("rid %d: KV from prefill %d, whose pool handle never came; refused",
                         t.rid, t.prefill_worker)  # fmt: skip
            send(self.rel_out[t.prefill_worker], KVRelease(rid=t.rid, accepted=False))
            fail_request(self.tok_out, t.rid, t.detok_shard, len(t.output_ids))

    def _map_pool(self, msg: KVPoolHandle) -> None:
        i = msg.prefill_worker
        assert self.imports is not None and isinstance(self.receiver, CudaIpcReceiver)
        if not self.imports.is_new(i, msg.handle):
            return
        self._forget_pool(i)  # an older mapping of i belongs to a process that is gone
        try:
            self.receiver.open(i, msg.handle)
        except (RuntimeError, KVTransferError) as e:
            logger.error("cannot map prefill %d's KV pool (%s); its transfers are refused", i, e)
            self.imports.failed(i)
            return
        self.imports.mapped(i, msg.handle)
        logger.info("mapped prefill %d's KV pool", i)

    def _unmap_dead_pools(self) -> None:
        """A dead prefill's GPU memory is not valid to read: unmap it, drop what it sent."""
        assert self.imports is not None
        for i, ring in self.kv_in.items():
            if self.imports.is_mapped(i) and not ring.peer_alive():
                self._forget_pool(i)

    def _forget_pool(self, i: int) -> None:
        assert self.imports is not None and isinstance(self.receiver, CudaIpcReceiver)
        self.imports.lost(i)
        self.receiver.drop(i)
        stale = [t.rid for t in self.sched.pending if t.prefill_worker == i]
        for rid in stale:  # no release: the process that pinned the blocks is gone
            self.sched.abort(rid)
        if stale:
            logger.warning("prefill %d is gone: dropped %d pending transfers", i, len(stale))

    def _release(self, releases: list[tuple[int, KVRelease]]) -> None:
        for i, rel in releases:
            send(self.rel_out[i], rel)

    def _publish(self) -> None:
        a = self.sched.runner.allocator
        self.row.publish(
            queued_prefill_tokens=0,
            waiting_requests=self.sched.num_waiting,
            running_requests=self.sched.num_running,
            free_kv_blocks=a.num_available,  # cached blocks are evictable: room
            total_kv_blocks=a.num_blocks,
        )


def main() -> None:
    DecodeWorker().run()


if __name__ == "__main__":
    main()
