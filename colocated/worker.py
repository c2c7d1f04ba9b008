"""The co-located worker process: ``python -m colocated.worker`` (``launch --colocated N``).

Rings (c = this worker, k = detokenizer shard; see ``wire/ring_names.py``):
    req.f.c{c}      frontend -> c     GenerateRequest, AbortRequest
    tok.c{c}.k{k}   c -> detok k      TokenBatch (first tokens and decode tokens alike)
    stop.k{k}.c{c}  detok k -> c      AbortRequest (a stop string matched)
With ``launch --workers`` also the KV handoff rings to and from every other worker
(``colocated/handoff.py``): the worker then prefills for others and decodes for others.

Each step is one ``ColocatedScheduler`` step (prefill chunk, its first tokens sent at once,
adopt, decode); the loop around it is ``runtime.worker.Worker``'s.
"""

from __future__ import annotations

import time

from colocated.handoff import Handoff
from colocated.scheduler import ColocatedScheduler
from engine.build import build_engine
from engine.speculative.speculator import Speculator
from runtime.worker import Worker
from runtime.worker_io import drain, send
from transport.worker_load import WorkerLoad
from wire.records import AbortRequest, TokenBatch
from wire.ring_names import RingKind
from wire.roles import Role

# While only handed-off requests wait here for their grammar to compile (as a decode
# worker polls them, ``decode/worker.py``).
_GRAMMAR_POLL_S = 0.002


class ColocatedWorker(Worker):
    role = Role.COLOCATED

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        # launch --workers: the pool is a shared segment other workers copy from.
        self.handoff = None
        if self.settings.kv_transfer == "shm":
            self.handoff = Handoff(self.spec, self.rings, cfg)
        engine = build_engine(cfg, kv_pool=None if self.handoff is None else self.handoff.own_pool)
        self.engine, runner = engine, engine.runner
        runner.capture_decode_graphs()
        receiver = None if self.handoff is None else self.handoff.receiver(runner)
        self.sched = ColocatedScheduler(
            engine, self.index, cfg.chunked_prefill_size, cfg.max_num_seqs, receiver=receiver
        )
        self.stop_in = list(self.rings.sources(RingKind.STOP).values())

    def take_inputs(self) -> None:
        self.take_requests(self.sched)
        for ring in self.stop_in:
            for msg in drain(ring):
                if isinstance(msg, AbortRequest):
                    self.sched.abort(msg.rid)
                    if self.handoff is not None:
                        self.handoff.stopped(msg.rid)
        if self.handoff is not None:
            self.handoff.take_inputs(self.sched)

    def step(self) -> bool:
        if self.handoff is not None:
            self.handoff.admit(self.sched)
        out = self.sched.step(emit=self._send)
        for shard, batch in out.tokens:
            self._send(shard, batch)
        if self.handoff is not None:
            self.handoff.ship(out, self.sched, self.tok_out)
            self.handoff.release(self.sched.releases)  # aborts of handoffs this step
            self.sched.releases = []
            if self.sched.decode.admission.compiling and not self.sched.decode.running:
                time.sleep(_GRAMMAR_POLL_S)  # a handoff's grammar compiles: poll, no spin
        return self.sched.has_work

    def _send(self, shard: int, batch: TokenBatch) -> None:
        send(self.tok_out[shard], batch)

    def speculator(self) -> Speculator | None:
        return self.sched.decode.speculator

    def load(self) -> WorkerLoad:
        return self.sched.load()


def main() -> None:
    ColocatedWorker().run()


if __name__ == "__main__":
    main()
