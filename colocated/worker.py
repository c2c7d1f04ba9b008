"""The co-located worker process: ``python -m colocated.worker`` (``launch --colocated N``).

Rings (c = this worker, k = detokenizer shard; see ``wire/ring_names.py``):
    req.f.c{c}      frontend -> c     GenerateRequest, AbortRequest
    tok.c{c}.k{k}   c -> detok k      TokenBatch (first tokens and decode tokens alike)
    stop.k{k}.c{c}  detok k -> c      AbortRequest (a stop string matched)

Each step is one ``ColocatedScheduler`` step (prefill chunk, its first tokens sent at once,
adopt, decode); the loop around it is ``runtime.worker.Worker``'s.
"""

from __future__ import annotations

from colocated.scheduler import ColocatedScheduler
from engine.build import build_engine
from engine.runner import ModelRunner
from engine.speculative.speculator import Speculator
from runtime.worker import Worker
from runtime.worker_io import drain, send
from transport.worker_load import WorkerLoad
from wire.records import AbortRequest, TokenBatch
from wire.ring_names import RingKind
from wire.roles import Role


class ColocatedWorker(Worker):
    role = Role.COLOCATED

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        engine = build_engine(cfg)
        engine.runner.capture_decode_graphs()
        self.sched = ColocatedScheduler(
            engine, self.index, cfg.chunked_prefill_size, cfg.max_num_seqs
        )
        self.stop_in = list(self.rings.sources(RingKind.STOP).values())

    @property
    def runner(self) -> ModelRunner:
        return self.sched.runner

    def take_inputs(self) -> None:
        self.take_requests(self.sched)
        for ring in self.stop_in:
            for msg in drain(ring):
                if isinstance(msg, AbortRequest):
                    self.sched.abort(msg.rid)

    def step(self) -> bool:
        for shard, batch in self.sched.step(emit=self._send).tokens:
            self._send(shard, batch)
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
