"""A handoff's way into a decode worker's batch: the admission half of a decode request's
life, as an explicit state machine.

    offer(KVTransfer)
      ├─ its grammar is not compiled here yet ─► COMPILING ─(compiled)─► PENDING
      │                                          └─(does not compile)─► ENDED (ERROR)
      └─► PENDING ─ admit(), while the batch has room: blocks for its KV (the leading
            full blocks this pool holds are shared, not copied), then the copy started
            ├─ copied at once (shared memory) ─────────────► admitted: the batch's RUNNING
            ├─ a read posted (over a network) ─► READING ─(landed)─► admitted
            │                                            └─(failed)─► ENDED (LOST)
            ├─ refused as asked (bad block ids) ──────────► ENDED (ERROR)
            └─ the read failed at once ───────────────────► ENDED (LOST)
    abort: from COMPILING/PENDING at once; from READING to DRAINING, whose blocks are
    freed once the abandoned read has ended (until then it may still write them).

ENDED requests become a row without a token in the next step (``take_ended``): ERROR
ends the request, LOST hands it back to the frontend, which prefills it again.

I/O: the only I/O of a decode worker's scheduling is here, and it never blocks: the
receiver's ``start_fetch`` (a copy, or a read posted), ``poll`` of each read in flight
(``_poll_reads``, a few times per ``admit``) and ``abandon`` (``drain_abandoned``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.build import Engine
from engine.checkpoint.lora_loader import lora_refusal
from engine.kv.block_allocator import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.sampling.grammar import GrammarError
from transport.errors import KVReadFailed, KVTransferError
from transport.kv import KVRead, KVReceiver
from wire.records import Finish, KVRelease, KVTransfer

logger = logging.getLogger(__name__)

_ABORT_MEMORY = 4096  # aborted rids remembered for transfers still on their way
_POLLS_PER_ADMIT = 8  # checks of each read in flight per admit(), while it is not done

Releases = list[tuple[int, KVRelease]]  # (prefill worker, its release)


@dataclass
class Reading:
    """A handoff whose KV read is in flight (READING), or abandoned (DRAINING)."""

    t: KVTransfer
    seq: Sequence
    held: int  # tokens of KV this pool already held (prefix cache), not read
    read: KVRead


class Admission:
    """The COMPILING, PENDING, READING, DRAINING and ENDED requests of one decode worker."""

    def __init__(self, engine: Engine, receiver: KVReceiver) -> None:
        self.kv, self.grammars, self.loras = engine.kv, engine.grammars, engine.loras
        self.receiver = receiver
        self.compiling: list[KVTransfer] = []
        self.pending: deque[KVTransfer] = deque()
        self.reading: dict[int, Reading] = {}
        self.draining: list[Reading] = []
        self._ended: list[tuple[KVTransfer, Finish]] = []
        self._aborted: OrderedDict[int, None] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return len(self.compiling) + len(self.pending) + len(self.reading)

    def offer(self, t: KVTransfer) -> Releases:
        """A prefill worker has KV ready for ``t.rid``; refused at once if already aborted."""
        if t.rid in self._aborted:
            return [(t.prefill_worker, KVRelease(rid=t.rid, accepted=False))]
        why = lora_refusal(self.loras, t.sampling.lora)
        if why is not None:
            logger.error("rid %d: its LoRA adapter cannot run here: %s", t.rid, why)
            self._ended.append((t, Finish.ERROR))
            return [(t.prefill_worker, KVRelease(rid=t.rid, accepted=False))]
        if t.sampling.grammar is not None:
            self.grammars.prepare(t.sampling.grammar)
            self.compiling.append(t)
            return self._promote_compiled()
        self.pending.append(t)
        return []

    def abort(self, rid: int) -> Releases:
        """``rid`` leaves admission wherever it is (a read in flight goes to DRAINING)."""
        self._aborted[rid] = None
        while len(self._aborted) > _ABORT_MEMORY:
            self._aborted.popitem(last=False)
        releases = [
            (t.prefill_worker, KVRelease(rid=rid, accepted=False))
            for t in (*self.pending, *self.compiling)
            if t.rid == rid
        ]
        self.pending = deque(t for t in self.pending if t.rid != rid)
        self.compiling = [t for t in self.compiling if t.rid != rid]
        reading = self.reading.pop(rid, None)
        if reading is not None:
            self._drop_read(reading)
            releases.append((reading.t.prefill_worker, KVRelease(rid=rid, accepted=False)))
        return releases

    def take_ended(self) -> list[tuple[KVTransfer, Finish]]:
        ended, self._ended = self._ended, []
        return ended

    def admit(
        self, has_room: Callable[[], bool]
    ) -> tuple[list[tuple[Sequence, KVTransfer]], Releases]:
        """Start the copies of PENDING handoffs while ``has_room()``; returns the requests
        admitted (their sequences: KV in this pool, the newest token uncomputed) and the
        releases for prefill."""
        releases = self._promote_compiled() if self.compiling else []
        admitted: list[tuple[Sequence, KVTransfer]] = []
        if self.draining:
            self.drain_abandoned()
        if self.reading:
            self._poll_reads(admitted, releases)
        while self.pending and has_room():
            t = self.pending[0]
            try:
                started = self._start_read(t)
            except KVReadFailed as e:  # nothing in flight: it failed at once
                self.pending.popleft()
                self._lose(t, e, releases)
                continue
            except KVTransferError as e:  # refused as asked: it would be refused anywhere
                logger.error(
                    "rid %d: KV of prefill %d refused (%s); the request fails",
                    t.rid,
                    t.prefill_worker,
                    e,
                )
                self.pending.popleft()
                self._ended.append((t, Finish.ERROR))
                releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=False)))
                continue
            if started is None:
                break
            self.pending.popleft()
            if isinstance(started, Reading):
                self.reading[t.rid] = started
            else:
                admitted.append((started, t))
                releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=True)))
        return admitted, releases

    def drain_abandoned(self, prefill_worker: int | None = None) -> bool:
        """Free the blocks of abandoned reads that have ended; True if any from
        ``prefill_worker`` (any, if None) is still in flight."""
        still = []
        for r in self.draining:
            if r.read.abandon():
                self.kv.free_blocks(r.seq)
            else:
                still.append(r)
        self.draining = still
        return any(prefill_worker in (None, r.t.prefill_worker) for r in still)

    def _promote_compiled(self) -> Releases:
        """COMPILING handoffs whose grammar is compiled go to PENDING; failed ones end."""
        releases: Releases = []
        waiting: list[KVTransfer] = []
        for t in self.compiling:
            assert t.sampling.grammar is not None
            try:
                ready = self.grammars.ready(t.sampling.grammar)
            except GrammarError as e:
                logger.error("rid %d: its grammar does not compile: %s", t.rid, e)
                releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=False)))
                self._ended.append((t, Finish.ERROR))
                continue
            (self.pending if ready else waiting).append(t)
        self.compiling = waiting
        return releases

    def _start_read(self, t: KVTransfer) -> Sequence | Reading | None:
        """I/O: ``t``'s KV into this pool (held prefix blocks + copies of the rest); the
        read in flight if the copy has not landed yet; None and nothing held if the blocks
        for it cannot be had now."""
        kv, bs = self.kv, self.kv.block_size
        seq = Sequence(
            rid=t.rid,
            prompt_ids=list(t.prompt_ids),
            sampling=t.sampling,
            output_ids=list(t.output_ids),
            block_size=bs,
        )
        if kv.prefix_caching and t.block_hashes:
            # NOTE: only the KV's full blocks (num_tokens // bs) may be shared: the block
            # decode writes its next token into must be this sequence's own.
            seq.block_hashes = list(t.block_hashes[: t.num_tokens // bs])
            seq.block_table = kv.acquire_cached(seq.block_hashes)
            seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs
        held = seq.num_computed_tokens
        try:
            # Blocks for the rest of the KV plus the one uncomputed token decode runs next.
            kv.ensure_blocks(seq, t.num_tokens + 1 - held)
        except NoFreeBlocks:
            kv.free_blocks(seq)  # the held prefix goes back to the cache
            return None
        first, n_src = held // bs, -(-t.num_tokens // bs)
        try:
            read = self.receiver.start_fetch(
                t.prefill_worker, t.src_blocks[first:n_src], seq.block_table[first:n_src]
            )
        except KVTransferError:  # nothing is in flight (start_fetch saw to it)
            kv.free_blocks(seq)
            raise
        if read is not None:
            return Reading(t, seq, held, read)
        self._landed(t, seq, held)
        return seq

    def _poll_reads(self, admitted: list[tuple[Sequence, KVTransfer]], releases: Releases) -> None:
        """I/O: READING handoffs whose read has landed are admitted; failed ones end."""
        for rid, r in list(self.reading.items()):
            try:
                # A few checks: each progresses the transport, which moves a large read
                # on by what has arrived since the last step.
                if not any(r.read.poll() for _ in range(_POLLS_PER_ADMIT)):
                    continue
            except KVReadFailed as e:
                del self.reading[rid]
                self._drop_read(r)
                self._lose(r.t, e, releases)
                continue
            del self.reading[rid]
            self._landed(r.t, r.seq, r.held)
            admitted.append((r.seq, r.t))
            releases.append((r.t.prefill_worker, KVRelease(rid=rid, accepted=True)))

    def _landed(self, t: KVTransfer, seq: Sequence, held: int) -> None:
        """``t``'s KV has landed in ``seq``'s blocks: they are computed, and cacheable."""
        seq.num_computed_tokens = t.num_tokens
        self.kv.cache_full_blocks(seq, start=held)
        if seq.block_hashes:  # this worker's hit rate: handed-off KV it did not copy
            self.kv.count_prefix_lookup(t.num_tokens, held)

    def _lose(self, t: KVTransfer, e: KVReadFailed, releases: Releases) -> None:
        """``t``'s KV cannot be had (e.g. its prefill host died or is cut off): a LOST row
        tells the frontend, which re-prefills the request elsewhere."""
        logger.error(
            "rid %d: KV of prefill %d unreadable (%s); handed back to be prefilled again",
            t.rid,
            t.prefill_worker,
            e,
        )
        self._ended.append((t, Finish.LOST))
        releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=False)))

    def _drop_read(self, r: Reading) -> None:
        """DRAINING: free an abandoned read's blocks now, or once the read has ended."""
        self.draining.append(r)
        self.drain_abandoned()
