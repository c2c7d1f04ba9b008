"""The skeleton every engine worker process shares (prefill, decode, co-located).

    bootstrap (spec, title, signals) -> attach rings -> claim the load-table row
      -> build the engine (subclass) -> empty its prefix summary -> READY
      -> loop: take inputs -> step (on the cores it leases, if on CPU) -> publish load (and prefix summary changes) -> sleep
         on the doorbell if idle
      -> DRAINING on SIGTERM/SIGINT

A subclass supplies only what differs: ``take_inputs`` (drain its rings), ``step``
(run its scheduler, ship what it made; returns whether work remains) and ``load`` (its
queue figures). No I/O happens in schedulers; it all happens here and in subclasses.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import ClassVar, Protocol

import torch

from engine.build import Engine
from engine.speculative.speculator import SpeculationStats, Speculator
from runtime.cpu_affinity import place_engine_threads
from runtime.faults import crash_if_poisoned, crash_token
from runtime.process import attach_rings, bootstrap, load_table, prefix_summaries
from runtime.step_beat import StepBeat
from runtime.strict_spec import exit_on_bad_spec
from runtime.worker_io import IDLE_WAIT_S, drain, fail_request
from runtime.worker_spec import EngineWorkerSpec
from transport.core_lease import CoreLease, host_cores
from transport.load_table import WorkerState
from transport.prefix_summary import PrefixSummary
from transport.ring import Ring
from transport.worker_load import (
    SPECULATION_FIELDS,
    SPECULATION_POSITIONS,
    SPECULATION_SKIP_REASONS,
    WorkerLoad,
)
from wire.records import AbortRequest, Finish, GenerateRequest, ResetPrefixCache, UnloadLora
from wire.ring_names import Peer, RingKind
from wire.roles import Role

logger = logging.getLogger(__name__)


class TakesRequests(Protocol):
    """A scheduler that admits requests from the frontend (prefill, co-located)."""

    def add(self, req: GenerateRequest) -> Finish: ...
    def abort(self, rid: int) -> None: ...


class Worker(abc.ABC):
    """One engine worker process; ``main()`` of each role builds one and calls ``run()``."""

    role: ClassVar[Role]
    # Set by each role's ``__init__`` (``engine/build.py``): the pool, adapters and KV
    # figures this loop reports and resets.
    engine: Engine

    def __init__(self) -> None:
        self.spec, self.stopping = bootstrap()
        self.index = self.spec.index
        # A spec this worker cannot read stops it here, before it claims its row or maps
        # anything: the launcher reports the exit and does not restart it.
        self.settings = exit_on_bad_spec(self.spec.settings, EngineWorkerSpec)
        self.crash_token = crash_token(self.role)  # None unless a test asked for it
        self.config = self.settings.engine
        self.rings = attach_rings(self.spec)
        self.table, self._load_seg = load_table(self.spec)
        self.row = self.table.writer(self.spec.load_table["slot"])
        # The node's name travels in the row: /health and /metrics say where a worker runs.
        self.row.claim(
            self.role, self.index, block_size=self.config.block_size, node=self.settings.node
        )
        # CPU workers lease cores per step (transport/core_lease.py); on a GPU the host
        # threads only feed the device.
        self.cores: CoreLease | None = None
        if torch.device(self.config.device).type == "cpu":
            self.cores = self.table.core_lease(self.spec.load_table["slot"], host_cores())
        # Every engine worker sends tokens to detokenizer shards, by shard index.
        self.tok_out: dict[int, Ring] = self.rings.sinks(RingKind.TOK)
        # Prefill and co-located workers: one request ring from each frontend.
        self.req_in: list[Ring] = list(self.rings.sources(RingKind.REQ).values())
        self.summary: PrefixSummary | None = None  # opened in run(), once the engine exists
        self.prefix_reset_epoch = 0  # the latest ResetPrefixCache done (reported each step)

    @abc.abstractmethod
    def take_inputs(self) -> None:
        """Drain every inbound ring into the scheduler."""

    @abc.abstractmethod
    def step(self) -> bool:
        """One scheduler step, its outputs shipped; True if work remains (do not sleep)."""

    @abc.abstractmethod
    def load(self) -> WorkerLoad:
        """This step's queue figures (``queued_prefill_tokens`` to ``prompt_tokens_received``
        and ``computed_prefill_tokens``); the KV and speculation figures are added here."""

    def speculator(self) -> Speculator | None:
        """This worker's speculative decoding, if it runs any (decode, co-located)."""
        return None

    def has_compute(self) -> bool:
        """Whether the next step runs the model (so leases cores): by default, whenever
        requests wait or run here."""
        q = self.load()
        return bool(q.waiting_requests or q.running_requests)

    def take_requests(self, sched: TakesRequests) -> None:
        """Drain every frontend's request ring into ``sched``; a request that can never run
        here ends at once with an error (its shard tells the client). Each ring is FIFO,
        so the forks of an ``n > 1`` request still follow their leader."""
        for ring in self.req_in:
            for msg in drain(ring):
                if isinstance(msg, GenerateRequest):
                    crash_if_poisoned(self.crash_token, msg.prompt_ids)  # tests only
                    if sched.add(msg) == Finish.ERROR:
                        fail_request(self.tok_out, msg.rid, msg.detok_shard, len(msg.output_ids))
                elif isinstance(msg, AbortRequest):
                    sched.abort(msg.rid)
                elif isinstance(msg, ResetPrefixCache):
                    self.reset_prefix_cache(msg)
                elif isinstance(msg, UnloadLora):
                    self.unload_lora(msg)

    def reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        """Between steps: the pool forgets its prefixes; the row reports ``msg.epoch``."""
        dropped = self.engine.kv.reset_prefix_cache()
        self.prefix_reset_epoch = max(self.prefix_reset_epoch, msg.epoch)
        logger.info("prefix cache reset (epoch %d): %d blocks forgotten", msg.epoch, dropped)

    def unload_lora(self, msg: UnloadLora) -> None:
        """Between steps: free the adapter's slot (a request still running under it loads
        it again and the first step without one evicts it); the row's ``lora_adapters``
        shows it gone after this step."""
        loras = self.engine.loras
        if loras is not None and loras.retire(msg.fingerprint):
            logger.info("LoRA adapter %s unloaded", msg.fingerprint)

    def _open_summary(self) -> PrefixSummary | None:
        """This worker's prefix summary, emptied (a predecessor's pool is gone), or None."""
        me = str(Peer(self.role, self.index))
        mapped = prefix_summaries(self.spec).get(me)
        if mapped is None or not self.config.enable_prefix_caching:
            return None
        summary, self._summary_seg = mapped
        summary.clear()
        self.engine.kv.watch_prefix_hashes()  # from now on every hash change reaches the summary
        return summary

    def run(self) -> None:
        self.summary = self._open_summary()
        self.row.set_state(WorkerState.READY)
        logger.info("ready")
        inbound = list(self.rings.inbound.values())
        self.engine.kv.defer_tier_stores = True  # stored below, once the step's tokens are out
        # A step longer than the router's staleness bound must not read as a death.
        beat = StepBeat(self.row, IDLE_WAIT_S)
        if self.cores is not None:  # last: threads started from here on share its core
            place_engine_threads(self.cores.cores)  # runtime/cpu_affinity.py
        while not self.stopping:
            beat.start()
            self.take_inputs()
            busy = self._leased_step() if self.cores is not None else self.step()
            self.engine.kv.store_offered()
            self._publish()
            beat.end()
            if not busy:
                self.rings.doorbell.wait(inbound, IDLE_WAIT_S)
        self.row.set_state(WorkerState.DRAINING)

    def _leased_step(self) -> bool:
        """``step`` on as many cores as the lease gives, when there is work to compute."""
        assert self.cores is not None
        if not self.has_compute():
            return self.step()
        with self.cores.hold(self.cores.cores) as granted:
            if granted != torch.get_num_threads():
                torch.set_num_threads(granted)
            return self.step()

    def _publish(self) -> None:
        kv = self.engine.kv.figures()
        if self.summary is not None:
            self.summary.update(*self.engine.kv.take_prefix_hash_changes())
        speculator = self.speculator()
        self.row.publish(
            dataclasses.replace(
                self.load(),
                free_kv_blocks=kv.free_blocks,  # cached blocks are evictable room
                total_kv_blocks=kv.total_blocks,
                cached_blocks=kv.hashed_blocks,
                prefix_hit_tokens=kv.hit_tokens,
                prefix_queried_tokens=kv.queried_tokens,
                **self._lora_counters(),
                prefix_reset_epoch=self.prefix_reset_epoch,
                **(speculation_counters(speculator.stats) if speculator is not None else {}),
            )
        )

    def _lora_counters(self) -> dict[str, int]:
        loras = self.engine.loras
        if loras is None:
            return {}
        return {"lora_adapters": len(loras.resident), "lora_loads": loras.loads}


def speculation_counters(stats: SpeculationStats) -> dict[str, int]:
    """``stats`` as ``WorkerLoad``'s ``spec_*`` fields."""
    per_pos = (stats.accepted_per_pos + [0] * SPECULATION_POSITIONS)[:SPECULATION_POSITIONS]
    skipped = [stats.skipped[r] for r in SPECULATION_SKIP_REASONS]
    totals = [stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens]
    return dict(zip(SPECULATION_FIELDS, [*totals, *per_pos, *skipped], strict=True))
