"""The decode worker process: ``python -m decode.worker`` (started by the launcher).

Loop: take KV handoffs, aborts (frontend) and stop notices (detokenizer) off the rings ->
admit handoffs that fit (copy KV, release prefill's blocks) -> one decode step for every
running request -> ship tokens to detokenizer shards -> publish load. Sleeps on its
doorbell when nothing runs.

KV backends (settings ``kv_transfer``): ``shm`` copies from each prefill worker's shared
segment (its pool on CPU, its pinned staging mirror on GPU); ``cuda_ipc`` maps each
prefill GPU pool from the handle that arrives on ``kv.p{i}.d{j}`` before any transfer,
and accepts transfers only from pools it has mapped (transport/kv_handles.py); ``nixl``
(a node that joined a cluster) does the same with pools on other hosts, read by NIXL.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from decode.scheduler import DecodeScheduler
from engine.build import Engine, build_engine
from engine.kv.kv_cache import layout_of
from engine.speculative.speculator import Speculator
from runtime.faults import crash_if_poisoned
from runtime.worker import Worker
from runtime.worker_io import drain, fail_request, send
from transport.errors import KVTransferError
from transport.kv import KVReceiver, pool_view
from transport.kv_backends import CudaIpcReceiver, ShmReceiver, register_host_memory
from transport.kv_handles import PoolImports, Verdict
from transport.kv_nixl import NixlReceiver
from transport.segment import Segment, SegmentSpec
from transport.worker_load import WorkerLoad
from wire.kv_layout import KVLayout
from wire.records import (
    AbortRequest,
    KVPoolHandle,
    KVRelease,
    KVTransfer,
    ResetPrefixCache,
    UnloadLora,
)
from wire.ring_names import Peer, RingKind
from wire.roles import Role

logger = logging.getLogger(__name__)
# While only handoffs waiting for their grammar to compile are here: poll, do not spin
# (the compile thread needs the core) and do not sleep on the doorbell (nothing rings it).
_GRAMMAR_POLL_S = 0.002
# While only KV reads are in flight: each admit() polls them (and progresses the NIXL
# agent); a READ of a few MB over TCP lands in about a millisecond or two.
_READ_POLL_S = 0.0002
_SETTLE_S = 1.0  # how long a lost pool's abandoned reads may take to end before it goes
_MAPPED = (CudaIpcReceiver, NixlReceiver)  # receivers that map pools from their handles


class DecodeWorker(Worker):
    role = Role.DECODE

    def __init__(self) -> None:
        super().__init__()
        self.engine = engine = build_engine(self.config)
        engine.runner.capture_decode_graphs()
        self.imports: PoolImports | None = None
        self.receiver: KVReceiver
        if self.settings.kv_transfer == "cuda_ipc":
            self.imports, self.receiver = PoolImports(), CudaIpcReceiver({}, engine.kv.tensor)
        elif self.settings.kv_transfer == "nixl":
            self.imports, self.receiver = PoolImports(), self._nixl_receiver(engine)
        else:
            self.receiver = self._shm_receiver(engine)
        self.sched = DecodeScheduler(engine, self.receiver, self.config.max_num_seqs)
        self.kv_in = self.rings.sources(RingKind.KV)
        self.ctl_in = [r for n, r in self.rings.inbound.items() if n.kind is not RingKind.KV]
        self.rel_out = self.rings.sinks(RingKind.REL)

    def _nixl_receiver(self, engine: Engine) -> NixlReceiver:
        """On a node that joined a cluster: prefill pools are on another host, read by NIXL
        from the handle each prefill worker sends (``transport/kv_nixl.py``)."""
        name = f"{self.settings.node}-decode-{self.index}-{os.getpid()}"
        return NixlReceiver(
            engine.kv.tensor, layout_of(engine.kv.tensor, engine.runner.backend.kv_order), name
        )

    def _shm_receiver(self, engine: Engine) -> ShmReceiver:
        """Map every prefill worker's shared pool (or staging mirror); copies read from it."""
        self._pool_segs: list[Segment] = []
        sources: dict[int, torch.Tensor] = {}
        for name, pool in self.spec.kv_pools.items():
            seg = Segment.attach(SegmentSpec(f"kv.{name}", pool["fd"], pool["nbytes"]))
            self._pool_segs.append(seg)
            i = Peer.parse(name).index  # the prefill worker whose pool it is
            sources[i] = pool_view(seg, KVLayout(**pool["layout"]))
            if engine.runner.device.type == "cuda":
                register_host_memory(sources[i])  # host -> GPU copies by DMA
        return ShmReceiver(sources, engine.kv.tensor)

    def step(self) -> bool:
        if self.imports is not None:
            self._unmap_dead_pools()
        self._release(self.sched.admit())
        admission = self.sched.admission
        for shard, batch in self.sched.step().tokens.items():
            send(self.tok_out[shard], batch)
        if not self.sched.running:
            if admission.reading:  # nothing to step: poll the reads in flight, gently
                time.sleep(_READ_POLL_S)
            elif admission.compiling:
                time.sleep(_GRAMMAR_POLL_S)
        return bool(self.sched.running or admission.compiling or admission.reading)

    def take_inputs(self) -> None:
        for ring in self.ctl_in:
            for msg in drain(ring):
                if isinstance(msg, AbortRequest):
                    self._release(self.sched.abort(msg.rid))
                elif isinstance(msg, ResetPrefixCache):
                    self.reset_prefix_cache(msg)
                elif isinstance(msg, UnloadLora):
                    self.unload_lora(msg)
        for ring in self.kv_in.values():
            for msg in drain(ring):
                if isinstance(msg, KVTransfer):
                    self._offer(msg)
                elif isinstance(msg, KVPoolHandle):
                    self._map_pool(msg)

    def _offer(self, t: KVTransfer) -> None:
        crash_if_poisoned(self.crash_token, t.prompt_ids)  # tests only (runtime/faults.py)
        verdict = Verdict.ACCEPT if self.imports is None else self.imports.verdict(t.prefill_worker)
        if verdict is Verdict.ACCEPT:
            self._release(self.sched.offer(t))
        elif verdict is Verdict.DROP:  # the frontend resumes it: prefill i has died
            logger.info("rid %d: dropped, its prefill worker %d died", t.rid, t.prefill_worker)
        else:
            logger.error(
                "rid %d: KV from prefill %d, whose pool handle never came; refused",
                t.rid,
                t.prefill_worker,
            )
            send(self.rel_out[t.prefill_worker], KVRelease(rid=t.rid, accepted=False))
            fail_request(self.tok_out, t.rid, t.detok_shard, len(t.output_ids))

    def _map_pool(self, msg: KVPoolHandle) -> None:
        i = msg.prefill_worker
        assert self.imports is not None and isinstance(self.receiver, _MAPPED)
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
        """A dead prefill's GPU memory is not valid to read: unmap it, drop what it sent.

        Over ``nixl`` the ring's producer is this node's gateway, not the prefill process:
        a prefill host that died shows as failed reads instead, and a restarted prefill
        worker as a new handle (``_map_pool``)."""
        assert self.imports is not None
        if self.settings.kv_transfer == "nixl":
            return
        for i, ring in self.kv_in.items():
            if self.imports.is_mapped(i) and not ring.peer_alive():
                self._forget_pool(i)

    def _forget_pool(self, i: int) -> None:
        assert self.imports is not None and isinstance(self.receiver, _MAPPED)
        self.imports.lost(i)
        admission = self.sched.admission
        stale = [t.rid for t in admission.pending if t.prefill_worker == i]
        stale += [rid for rid, r in admission.reading.items() if r.t.prefill_worker == i]
        for rid in stale:  # no release: the process that pinned the blocks is gone
            self.sched.abort(rid)
        # Reads from a dead source end soon (their connection is gone); the pool is
        # unmapped after them, not under them.
        deadline = time.monotonic() + _SETTLE_S
        while admission.drain_abandoned(i) and time.monotonic() < deadline:
            time.sleep(_READ_POLL_S)
        self.receiver.drop(i)
        if stale:
            logger.warning("prefill %d is gone: dropped %d pending transfers", i, len(stale))

    def _release(self, releases: list[tuple[int, KVRelease]]) -> None:
        for i, rel in releases:
            send(self.rel_out[i], rel)

    def has_compute(self) -> bool:
        # Reads in flight alone are only polled: no cores held while the bytes cross.
        s, a = self.sched, self.sched.admission
        return bool(s.running or a.pending or s.preempted or a.compiling)

    def speculator(self) -> Speculator | None:
        return self.sched.speculator

    def load(self) -> WorkerLoad:
        s = self.sched
        return WorkerLoad(waiting_requests=s.num_waiting, running_requests=s.num_running)


def main() -> None:
    DecodeWorker().run()


if __name__ == "__main__":
    main()
