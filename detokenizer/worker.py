"""The detokenizer shard process: rings in, ``DetokShard``, rings out.

Each loop iteration drains the frontends' control rings first (so a registration is seen
before, or with, its first tokens), then every prefill and decode token ring, and writes
at most one TextBatch to each frontend (a request's text goes to the frontend that owns
it, named in its rid: ``wire/rids.py``) plus the stop notifications to decode workers.
With nothing to read it sleeps on its doorbell (no CPU while idle).

A frontend that dies takes its clients with it: first thing each iteration, the shard
looks at each frontend's text ring, and when its reader has exited or been replaced (a
restart), abandons that frontend's requests (``DetokShard.abandon``): their decode
workers are told to stop them, so their KV is freed. The other frontends' requests go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from detokenizer.shard import DetokShard
from engine.tokenizer.hf_tokenizer import load_tokenizer
from runtime.process import ProcessSpec, bootstrap
from runtime.strict_spec import DetokWorkerSpec, exit_on_bad_spec
from transport.doorbell import Doorbell, DoorbellSpec
from transport.errors import PeerDead
from transport.ring import Ring, RingSpec
from wire.records import (
    AbortRequest,
    DetokRegister,
    TextBatch,
    TextDelta,
    TokenBatch,
    decode,
    encode,
)
from wire.rids import owner_of
from wire.ring_names import RingKind, RingName
from wire.roles import Role

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DetokWorkerConfig:
    index: int  # this shard's k
    tokenizer_path: str
    doorbell: DoorbellSpec  # the doorbell every inbound ring rings
    control: tuple[RingSpec, ...]  # frontend n -> shard: DetokRegister, AbortRequest
    prefill_rings: tuple[RingSpec, ...]  # prefill i -> shard, TokenBatch
    decode_rings: tuple[RingSpec, ...]  # decode j -> shard, TokenBatch
    stop_rings: tuple[RingSpec, ...]  # shard -> decode j, AbortRequest
    frontends: tuple[RingSpec, ...]  # shard -> frontend n, TextBatch
    max_records: int = 256  # per ring per iteration: bounds the latency one ring can add
    put_timeout_s: float = 5.0
    idle_wait_s: float = 0.5


class DetokWorker:
    def __init__(self, cfg: DetokWorkerConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.shard = DetokShard(tokenizer)
        self.bell = Doorbell.attach(cfg.doorbell)
        self.control = [Ring.attach(s, "consumer", self.bell) for s in cfg.control]
        # (decode worker index or None for prefill, ring)
        self.token_rings: list[tuple[int | None, Ring]] = [
            (None, Ring.attach(s, "consumer", self.bell)) for s in cfg.prefill_rings
        ]
        self.token_rings += [
            (j, Ring.attach(s, "consumer", self.bell)) for j, s in enumerate(cfg.decode_rings)
        ]
        self.stop_rings = [Ring.attach(s, "producer") for s in cfg.stop_rings]
        self.frontends = [Ring.attach(s, "producer") for s in cfg.frontends]
        self.readers = [0] * len(self.frontends)  # each text ring's reader pid, as last seen
        self.gone: set[int] = set()  # frontends whose reader has exited
        self.inbound = [*self.control, *(ring for _, ring in self.token_rings)]

    def step(self) -> bool:
        """One iteration; True if any record was read."""
        self._watch_frontends()  # before registrations: a restarted frontend's new ones stay
        busy = False
        for ring in self.control:
            for raw in ring.drain(self.cfg.max_records):
                busy = True
                msg = decode(raw)
                if isinstance(msg, DetokRegister):
                    self.shard.register(msg)
                elif isinstance(msg, AbortRequest):
                    self.shard.abort(msg.rid)
                else:
                    logger.error(
                        "shard %d: unexpected control record %s", self.cfg.index, type(msg)
                    )
        for source, ring in self.token_rings:
            for raw in ring.drain(self.cfg.max_records):
                busy = True
                batch = decode(raw)
                assert isinstance(batch, TokenBatch), type(batch)
                self.shard.on_tokens(batch, source)
        text, stops = self.shard.take_outputs()
        if text is not None:
            self._send_text(text)
        for j, abort in stops:
            self.stop_rings[j].put(encode(abort), self.cfg.put_timeout_s)
        return busy

    def _watch_frontends(self) -> None:
        """Abandon the requests of a frontend whose reader exited or was replaced."""
        for n, ring in enumerate(self.frontends):
            alive, pid = ring.peer_alive(), ring.peer_pid
            if alive and pid == self.readers[n]:
                continue
            # Dead: every step, also registrations drained since. Replaced: what the
            # predecessor registered (the watch runs before this step's registrations).
            if abandoned := self.shard.abandon(n):
                logger.warning(
                    "shard %d: frontend %d is gone; abandoned its %d requests",
                    self.cfg.index,
                    n,
                    len(abandoned),
                )
            self.readers[n] = pid
            if alive:
                self.gone.discard(n)
            else:
                self.gone.add(n)

    def _send_text(self, text: TextBatch) -> None:
        """Each request's deltas to the frontend that owns it; none to a frontend gone."""
        if len(self.frontends) == 1:
            by_owner = {0: text}
        else:
            groups: dict[int, list[TextDelta]] = {}
            for delta in text.items:
                groups.setdefault(owner_of(delta.rid), []).append(delta)
            by_owner = {n: TextBatch(items=items) for n, items in groups.items()}
        for n, batch in by_owner.items():
            if n in self.gone or n >= len(self.frontends):
                continue
            try:
                self.frontends[n].put(encode(batch), self.cfg.put_timeout_s)
            except PeerDead:  # it died since the watch: its requests go at the next step
                self.gone.add(n)

    def run(self, should_stop: Callable[[], bool]) -> None:
        # Straight to the bell after every step: its wait returns at once if a ring holds
        # more (records past ``max_records``, or new ones), so a second, empty step
        # before sleeping (a token's whole pass again, at one stream) finds nothing new.
        while not should_stop():
            self.step()
            self.bell.wait(self.inbound, self.cfg.idle_wait_s)

    def close(self) -> None:
        for ring in [*self.inbound, *self.stop_rings, *self.frontends]:
            ring.close()


def main(cfg: DetokWorkerConfig, should_stop: Callable[[], bool]) -> None:
    """Process entry point (the launcher passes the config and its shutdown flag)."""
    worker = DetokWorker(cfg, load_tokenizer(cfg.tokenizer_path))
    logger.info("detokenizer shard %d ready", cfg.index)
    try:
        worker.run(should_stop)
    finally:
        worker.close()


def config_from_spec(spec: ProcessSpec) -> DetokWorkerConfig:
    """The shard's rings as the launcher's topology names them (``wire/ring_names.py``)."""
    inbound = {RingName.parse(n): RingSpec(**s) for n, s in spec.rings_in.items()}
    outbound = {RingName.parse(n): RingSpec(**s) for n, s in spec.rings_out.items()}

    def sources(kind: RingKind, *roles: Role) -> tuple[RingSpec, ...]:
        names = sorted(n for n in inbound if n.kind is kind and n.src.role in roles)
        return tuple(inbound[n] for n in names)

    return DetokWorkerConfig(
        index=spec.index,
        tokenizer_path=exit_on_bad_spec(spec.settings, DetokWorkerSpec).model,
        doorbell=DoorbellSpec(spec.doorbell_fd),
        control=sources(RingKind.CTL, Role.FRONTEND),  # by frontend index
        prefill_rings=sources(RingKind.TOK, Role.PREFILL),
        # A server has decode workers or co-located ones, never both: either way ring j
        # here pairs with stop ring j (co-located workers send first tokens on it too).
        decode_rings=sources(RingKind.TOK, Role.DECODE, Role.COLOCATED),
        stop_rings=tuple(outbound[n] for n in sorted(outbound) if n.kind is RingKind.STOP),
        frontends=tuple(outbound[n] for n in sorted(outbound) if n.kind is RingKind.TEXT),
    )


if __name__ == "__main__":
    _spec, _stopping = bootstrap()
    main(config_from_spec(_spec), lambda: bool(_stopping))
