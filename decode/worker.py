"""The decode worker process: ``python -m decode.worker`` (started by the launcher).

Loop: take KV handoffs, aborts (frontend) and stop notices (detokenizer) off the rings ->
admit handoffs that fit (copy KV, release prefill's blocks) -> one decode step for every
running request -> ship tokens to detokenizer shards -> publish load. Sleeps on its
doorbell when nothing runs.
"""

from __future__ import annotations

import logging

import torch

from decode.scheduler import DecodeScheduler
from engine.runner import ModelRunner
from pdserve.process import attach_rings, bootstrap, load_row
from pdserve.worker_io import IDLE_WAIT_S, drain, engine_config, rings_by_peer, send
from router.load_table import Role, WorkerState
from transport.kv import KVLayout, pool_view
from transport.kv_backends import ShmReceiver
from transport.records import AbortRequest, KVRelease, KVTransfer
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
        self.sched = DecodeScheduler(runner, self._receiver(runner), config.max_num_seqs)
        self.kv_in = [r for n, r in self.rings_in.items() if n.startswith("kv.")]
        self.ctl_in = [r for n, r in self.rings_in.items() if not n.startswith("kv.")]
        self.rel_out = rings_by_peer(self.rings_out, "rel.")
        self.tok_out = rings_by_peer(self.rings_out, "tok.")

    def _receiver(self, runner: ModelRunner) -> ShmReceiver:
        """Map every prefill worker's shared pool; copies read straight from it."""
        self._pool_segs: list[Segment] = []
        sources: dict[int, torch.Tensor] = {}
        for name, pool in self.spec.kv_pools.items():
            seg = Segment.attach(SegmentSpec(f"kv.{name}", pool["fd"], pool["nbytes"]))
            self._pool_segs.append(seg)
            sources[int(name[1:])] = pool_view(seg, KVLayout(**pool["layout"]))
        return ShmReceiver(sources, runner.kv_pool)

    def run(self) -> None:
        self.row.set_state(WorkerState.READY)
        logger.info("ready")
        while not self.stopping:
            self._take_inputs()
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
        for ring in self.kv_in:
            for msg in drain(ring):
                if isinstance(msg, KVTransfer):
                    self._release(self.sched.offer(msg))

    def _release(self, releases: list[tuple[int, KVRelease]]) -> None:
        for i, rel in releases:
            send(self.rel_out[i], rel)

    def _publish(self) -> None:
        a = self.sched.runner.allocator
        self.row.publish(
            queued_prefill_tokens=0,
            waiting_requests=self.sched.num_waiting,
            running_requests=self.sched.num_running,
            free_kv_blocks=a.num_free,
            total_kv_blocks=a.num_blocks,
        )


def main() -> None:
    DecodeWorker().run()


if __name__ == "__main__":
    main()
