"""The co-located worker process: ``python -m colocated.worker`` (``launch --colocated N``).

Rings (c = this worker, k = detokenizer shard):
    req.c{c}        frontend -> c     GenerateRequest, AbortRequest
    tok.c{c}.k{k}   c -> detok k      TokenBatch (first tokens and decode tokens alike)
    stop.k{k}.c{c}  detok k -> c      AbortRequest (a stop string matched)

Loop: take requests and aborts off the rings -> one ``ColocatedScheduler`` step (prefill
chunk, adopt, decode) -> ship tokens -> publish load (Role.COLOCATED). With nothing to do
it sleeps on its doorbell (no CPU while idle).
"""

from __future__ import annotations

import logging

from colocated.scheduler import ColocatedScheduler
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
from transport.records import AbortRequest, Finish, GenerateRequest

logger = logging.getLogger(__name__)


class ColocatedWorker:
    def __init__(self) -> None:
        self.spec, self.stopping = bootstrap()
        c = self.index = self.spec.index
        self.rings_in, self.rings_out, self.doorbell = attach_rings(self.spec)
        self.row, self._load_seg = load_row(self.spec)
        config = engine_config(self.spec.settings)
        self.row.claim(Role.COLOCATED, c, block_size=config.block_size)
        runner = ModelRunner(config)
        self.sched = ColocatedScheduler(runner, c, config.chunked_prefill_size, config.max_num_seqs)
        self.req_ring = self.rings_in[f"req.c{c}"]
        self.stop_in = [r for n, r in self.rings_in.items() if n.startswith("stop.")]
        self.tok_out = rings_by_peer(self.rings_out, "tok.")

    def run(self) -> None:
        self.row.set_state(WorkerState.READY)
        logger.info("ready")
        while not self.stopping:
            self._take_inputs()
            out = self.sched.step()
            for shard, batch in out.tokens:
                send(self.tok_out[shard], batch)
            self._publish()
            if not self.sched.has_work:
                self.doorbell.wait(list(self.rings_in.values()), IDLE_WAIT_S)
        self.row.set_state(WorkerState.DRAINING)

    def _take_inputs(self) -> None:
        for msg in drain(self.req_ring):
            if isinstance(msg, GenerateRequest):
                if self.sched.add(msg) == Finish.ERROR:
                    fail_request(self.tok_out, msg.rid, msg.detok_shard, len(msg.output_ids))
            elif isinstance(msg, AbortRequest):
                self.sched.abort(msg.rid)
        for ring in self.stop_in:
            for msg in drain(ring):
                if isinstance(msg, AbortRequest):
                    self.sched.abort(msg.rid)

    def _publish(self) -> None:
        a = self.sched.runner.allocator
        self.row.publish(
            queued_prefill_tokens=self.sched.queued_tokens,
            waiting_requests=self.sched.num_waiting,
            running_requests=self.sched.num_running,
            free_kv_blocks=a.num_available,  # cached blocks are evictable: room
            total_kv_blocks=a.num_blocks,
            requests_received=self.sched.requests_received,
            prompt_tokens_received=self.sched.prompt_tokens_received,
        )


def main() -> None:
    ColocatedWorker().run()


if __name__ == "__main__":
    main()
