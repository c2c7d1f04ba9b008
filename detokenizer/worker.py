"""The detokenizer shard process: rings in, ``DetokShard``, rings out.

Each loop iteration drains the frontend's control ring first (so a registration is seen
before, or with, its first tokens), then every prefill and decode token ring, and writes
at most one TextBatch to the frontend plus the stop notifications to decode workers.
With nothing to read it sleeps on its doorbell (no CPU while idle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from detokenizer.shard import DetokShard
from pdserve.process import ProcessSpec, bootstrap
from transport.doorbell import Doorbell, DoorbellSpec
from transport.records import AbortRequest, DetokRegister, TokenBatch, decode, encode
from transport.ring import Ring, RingSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DetokWorkerConfig:
    index: int  # this shard's k
    tokenizer_path: str
    doorbell: DoorbellSpec  # the doorbell every inbound ring rings
    control: RingSpec  # frontend -> shard: DetokRegister, AbortRequest
    prefill_rings: tuple[RingSpec, ...]  # prefill i -> shard, TokenBatch
    decode_rings: tuple[RingSpec, ...]  # decode j -> shard, TokenBatch
    stop_rings: tuple[RingSpec, ...]  # shard -> decode j, AbortRequest
    frontend: RingSpec  # shard -> frontend, TextBatch
    max_records: int = 256  # per ring per iteration: bounds the latency one ring can add
    put_timeout_s: float = 5.0
    idle_wait_s: float = 0.5


class DetokWorker:
    def __init__(self, cfg: DetokWorkerConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.shard = DetokShard(tokenizer)
        self.bell = Doorbell.attach(cfg.doorbell)
        self.control = Ring.attach(cfg.control, "consumer", self.bell)
        # (decode worker index or None for prefill, ring)
        self.token_rings: list[tuple[int | None, Ring]] = [
            (None, Ring.attach(s, "consumer", self.bell)) for s in cfg.prefill_rings
        ]
        self.token_rings += [
            (j, Ring.attach(s, "consumer", self.bell)) for j, s in enumerate(cfg.decode_rings)
        ]
        self.stop_rings = [Ring.attach(s, "producer") for s in cfg.stop_rings]
        self.frontend = Ring.attach(cfg.frontend, "producer")
        self.inbound = [self.control, *(ring for _, ring in self.token_rings)]

    def step(self) -> bool:
        """One iteration; True if any record was read."""
        busy = False
        for raw in self.control.drain(self.cfg.max_records):
            busy = True
            msg = decode(raw)
            if isinstance(msg, DetokRegister):
                self.shard.register(msg)
            elif isinstance(msg, AbortRequest):
                self.shard.abort(msg.rid)
            else:
                logger.error("shard %d: unexpected control record %s", self.cfg.index, type(msg))
        for source, ring in self.token_rings:
            for raw in ring.drain(self.cfg.max_records):
                busy = True
                batch = decode(raw)
                assert isinstance(batch, TokenBatch), type(batch)
                self.shard.on_tokens(batch, source)
        text, stops = self.shard.take_outputs()
        if text is not None:
            self.frontend.put(encode(text), self.cfg.put_timeout_s)
        for j, abort in stops:
            self.stop_rings[j].put(encode(abort), self.cfg.put_timeout_s)
        return busy

    def run(self, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            if not self.step():
                self.bell.wait(self.inbound, self.cfg.idle_wait_s)

    def close(self) -> None:
        for ring in [*self.inbound, *self.stop_rings, self.frontend]:
            ring.close()


def main(cfg: DetokWorkerConfig, should_stop: Callable[[], bool]) -> None:
    """Process entry point (the launcher passes the config and its shutdown flag)."""
    from transformers import AutoTokenizer

    worker = DetokWorker(cfg, AutoTokenizer.from_pretrained(cfg.tokenizer_path))
    logger.info("detokenizer shard %d ready", cfg.index)
    try:
        worker.run(should_stop)
    finally:
        worker.close()


def config_from_spec(spec: ProcessSpec) -> DetokWorkerConfig:
    """The shard's rings as the launcher's topology names them (see launcher/topology.py)."""
    k = spec.index

    def ring(name: str, table: dict[str, dict[str, Any]]) -> RingSpec:
        return RingSpec(**table[name])

    def indexed(prefix: str, table: dict[str, dict[str, Any]]) -> tuple[RingSpec, ...]:
        names = sorted((n for n in table if n.startswith(prefix)), key=_peer_index)
        return tuple(RingSpec(**table[n]) for n in names)

    return DetokWorkerConfig(
        index=k,
        tokenizer_path=spec.settings["model"],
        doorbell=DoorbellSpec(spec.doorbell_fd),
        control=ring(f"ctl.k{k}", spec.rings_in),
        prefill_rings=indexed("tok.p", spec.rings_in),
        # A server has decode workers or co-located ones, never both: either way ring j
        # here pairs with stop ring j (co-located workers send first tokens on it too).
        decode_rings=indexed("tok.d", spec.rings_in) + indexed("tok.c", spec.rings_in),
        stop_rings=indexed("stop.", spec.rings_out),
        frontend=ring(f"text.k{k}", spec.rings_out),
    )


def _peer_index(name: str) -> int:
    """``tok.d3.k0`` -> 3, ``stop.k0.c3`` -> 3: the worker index in a ring name."""
    part = name.split(".")[1] if name.startswith("tok.") else name.split(".")[2]
    return int(part[1:])


if __name__ == "__main__":
    _spec, _stopping = bootstrap()
    main(config_from_spec(_spec), lambda: bool(_stopping))
