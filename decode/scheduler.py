"""The decode scheduler: KV import, continuous batching, engine stop checks.

One ``DecodeScheduler`` lives in each decode worker and, like the prefill scheduler, does
no I/O: the worker feeds it ``KVTransfer`` offers and aborts, calls ``admit()`` and
``step()``, and ships what they return.

Request life on a decode worker:
    offer(KVTransfer) -> pending -> admit(): blocks allocated, KV copied, KVRelease
      (over a network: the read posted -> reading, polled by each ``admit`` until the KV
      has landed, while the running requests keep stepping)
      -> running: one token per step, every running request in every step (with
         speculation, engine/spec/: a verified run of drafts and one more token)
      -> finished (EOS, stop token, length) or aborted: blocks freed the same step
With prefix caching, a handoff copies only the blocks this pool does not already hold
(the transfer names its blocks' hashes; the held ones are shared, not copied).
A request whose next block cannot be had is preempted: its blocks are freed and it is
recomputed here (one prefill over prompt + output) when room returns — it never goes back
to a prefill worker, and its output so far is kept. With prefix caching, imported and
generated blocks are published as they fill, so a preempted request reuses whichever
of its blocks were not evicted meanwhile.

A handoff whose grammar is not compiled here yet waits aside (``compiling``) while it
compiles on the grammar thread, so it holds up no other handoff; the matcher is rebuilt
by replaying the request's output so far when it is first sampled here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.kv.block_manager import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.sampling.grammar import GrammarError
from engine.sampling.sampler import SampleOutput
from engine.spec.speculator import Speculator
from engine.spec.verify import accepted_run
from runtime.step_output import TokenBatcher
from transport.errors import KVReadFailed, KVTransferError
from transport.kv import KVReceiver, PendingFetch
from wire.records import Finish, KVRelease, KVTransfer, TokenBatch

logger = logging.getLogger(__name__)

_ABORT_MEMORY = 4096  # aborted rids remembered for transfers still on their way
_POLLS_PER_ADMIT = 8  # checks of each read in flight per admit(), while it is not done


@dataclass
class _Running:
    seq: Sequence
    detok_shard: int


@dataclass
class _Reading:
    t: KVTransfer
    seq: Sequence
    held: int  # tokens of KV this pool already held (prefix cache), not read
    read: PendingFetch


@dataclass
class DecodeStep:
    tokens: dict[int, TokenBatch] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)


class DecodeScheduler:
    def __init__(self, runner: ModelRunner, receiver: KVReceiver, max_num_seqs: int) -> None:
        self.runner = runner
        self.receiver = receiver
        self.max_num_seqs = max_num_seqs
        self.pending: deque[KVTransfer] = deque()
        self.running: dict[int, _Running] = {}
        self.preempted: deque[_Running] = deque()
        self._aborted: OrderedDict[int, None] = OrderedDict()
        self.compiling: list[KVTransfer] = []  # offered; their grammar is compiling here
        # Handoffs that end here without a token, and how: ERROR (a grammar that does not
        # compile, a refused copy) or LOST (a read that failed); a row each next step.
        self._ended: list[tuple[KVTransfer, Finish]] = []
        self.reading: dict[int, _Reading] = {}  # rid -> its KV read in flight
        # Abandoned reads still in flight: their blocks are freed once each has ended
        # (it may yet write them).
        self.draining: list[_Reading] = []
        spec = runner.config.speculative
        self.spec = Speculator(runner, spec) if spec is not None else None

    # ---- inputs ------------------------------------------------------------------------

    def offer(self, t: KVTransfer) -> list[tuple[int, KVRelease]]:
        """A prefill worker has KV ready for ``t.rid``; refused at once if already aborted."""
        if t.rid in self._aborted:
            return [(t.prefill_worker, KVRelease(rid=t.rid, accepted=False))]
        why = self.runner.check_lora(t.sampling.lora)
        if why is not None:
            logger.error("rid %d: its LoRA adapter cannot run here: %s", t.rid, why)
            self._ended.append((t, Finish.ERROR))
            return [(t.prefill_worker, KVRelease(rid=t.rid, accepted=False))]
        if t.sampling.grammar is not None:
            self.runner.grammars.prepare(t.sampling.grammar)
            self.compiling.append(t)
            return self._promote_compiled()
        self.pending.append(t)
        return []

    def _promote_compiled(self) -> list[tuple[int, KVRelease]]:
        """Move handoffs whose grammar is compiled to ``pending``; refuse failed ones."""
        releases: list[tuple[int, KVRelease]] = []
        waiting: list[KVTransfer] = []
        for t in self.compiling:
            assert t.sampling.grammar is not None
            try:
                ready = self.runner.grammars.ready(t.sampling.grammar)
            except GrammarError as e:
                logger.error("rid %d: its grammar does not compile: %s", t.rid, e)
                releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=False)))
                self._ended.append((t, Finish.ERROR))
                continue
            (self.pending if ready else waiting).append(t)
        self.compiling = waiting
        return releases

    def abort(self, rid: int) -> list[tuple[int, KVRelease]]:
        """Stop ``rid`` wherever it is here; its blocks are free when this returns, but
        those of a read still in flight, freed once it has ended (``draining``)."""
        self._aborted[rid] = None
        while len(self._aborted) > _ABORT_MEMORY:
            self._aborted.popitem(last=False)
        releases = [(t.prefill_worker, KVRelease(rid=rid, accepted=False))
                    for t in (*self.pending, *self.compiling) if t.rid == rid]  # fmt: skip
        self.pending = deque(t for t in self.pending if t.rid != rid)
        self.compiling = [t for t in self.compiling if t.rid != rid]
        self.preempted = deque(r for r in self.preempted if r.seq.rid != rid)
        r = self.running.pop(rid, None)
        if r is not None:
            self.runner.free_blocks(r.seq)
        if self.spec is not None:
            self.spec.release(rid)
        reading = self.reading.pop(rid, None)
        if reading is not None:
            self._drop_read(reading)
            releases.append((reading.t.prefill_worker, KVRelease(rid=rid, accepted=False)))
        return releases

    def admit(self) -> list[tuple[int, KVRelease]]:
        """Import pending handoffs while there is room; returns releases for prefill.

        With prefix caching only the blocks this pool lacks are copied: the leading full
        blocks it already holds (found by the transfer's block hashes) are shared.
        """
        releases = self._promote_compiled() if self.compiling else []
        if self.draining:
            self.drain_abandoned()
        if self.reading:
            self._poll_reads(releases)
        while self.pending and self._has_room():
            t = self.pending[0]
            try:
                started = self._import(t)
            except KVReadFailed as e:  # nothing in flight: it failed at once
                self.pending.popleft()
                self._lose(t, e, releases)
                continue
            except KVTransferError as e:  # refused as asked: it would be refused anywhere
                logger.error("rid %d: KV of prefill %d refused (%s); the request fails",
                             t.rid, t.prefill_worker, e)  # fmt: skip
                self.pending.popleft()
                self._ended.append((t, Finish.ERROR))
                releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=False)))
                continue
            if started is None:
                break
            self.pending.popleft()
            if isinstance(started, _Reading):
                self.reading[t.rid] = started
            else:
                self.running[t.rid] = _Running(started, t.detok_shard)
                releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=True)))
        return releases

    def _poll_reads(self, releases: list[tuple[int, KVRelease]]) -> None:
        """Move the reads that have landed to ``running``; lose the ones that failed."""
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
            self._imported(r.t, r.seq, r.held)
            self.running[rid] = _Running(r.seq, r.t.detok_shard)
            releases.append((r.t.prefill_worker, KVRelease(rid=rid, accepted=True)))

    def _lose(self, t: KVTransfer, e: KVReadFailed, releases: list[tuple[int, KVRelease]]) -> None:
        """``t``'s KV cannot be had (e.g. its prefill host died or is cut off): a LOST row
        tells the frontend, which re-prefills the request elsewhere."""
        logger.error("rid %d: KV of prefill %d unreadable (%s); handed back to be "
                     "prefilled again", t.rid, t.prefill_worker, e)  # fmt: skip
        self._ended.append((t, Finish.LOST))
        releases.append((t.prefill_worker, KVRelease(rid=t.rid, accepted=False)))

    def _drop_read(self, r: _Reading) -> None:
        """Free an abandoned read's blocks now, or once the read has ended."""
        self.draining.append(r)
        self.drain_abandoned()

    def drain_abandoned(self, prefill_worker: int | None = None) -> bool:
        """Free the blocks of abandoned reads that have ended; True if any from
        ``prefill_worker`` (any, if None) is still in flight."""
        still = []
        for r in self.draining:
            if r.read.abandon():
                self.runner.free_blocks(r.seq)
            else:
                still.append(r)
        self.draining = still
        return any(prefill_worker in (None, r.t.prefill_worker) for r in still)

    def _import(self, t: KVTransfer) -> Sequence | _Reading | None:
        """``t``'s KV in this pool (held prefix blocks + copies of the rest); the read in
        flight if the copy has not landed yet; None and nothing held if the blocks for it
        cannot be had now."""
        runner, bs = self.runner, self.runner.block_size
        seq = Sequence(
            rid=t.rid, prompt_ids=list(t.prompt_ids), sampling=t.sampling,
            output_ids=list(t.output_ids), block_size=bs,
        )  # fmt: skip
        if runner.config.enable_prefix_caching and t.block_hashes:
            # NOTE: only the KV's full blocks (num_tokens // bs) may be shared: the block
            # decode writes its next token into must be this sequence's own.
            seq.block_hashes = list(t.block_hashes[: t.num_tokens // bs])
            seq.block_table = runner.acquire_cached(seq.block_hashes)
            seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs
        held = seq.num_computed_tokens
        try:
            # Blocks for the rest of the KV plus the one uncomputed token decode runs next.
            runner.ensure_blocks(seq, t.num_tokens + 1 - held)
        except NoFreeBlocks:
            runner.free_blocks(seq)  # the held prefix goes back to the cache
            return None
        first, n_src = held // bs, -(-t.num_tokens // bs)
        try:
            read = self.receiver.start_fetch(t.prefill_worker, t.src_blocks[first:n_src],
                                             seq.block_table[first:n_src])  # fmt: skip
        except KVTransferError:  # nothing is in flight (start_fetch saw to it)
            runner.free_blocks(seq)
            raise
        if read is not None:
            return _Reading(t, seq, held, read)
        self._imported(t, seq, held)
        return seq

    def _imported(self, t: KVTransfer, seq: Sequence, held: int) -> None:
        """``t``'s KV has landed in ``seq``'s blocks: they are computed, and cacheable."""
        seq.num_computed_tokens = t.num_tokens
        self.runner.cache_full_blocks(seq, start=held)
        if seq.block_hashes:  # this worker's hit rate: handed-off KV it did not copy
            self.runner.count_prefix_lookup(t.num_tokens, held)

    def adopt(self, seq: Sequence, detok_shard: int) -> None:
        """Run ``seq`` from its next step on, its KV already in this runner's blocks.

        For a prefill scheduler on the same runner (co-located): ``seq`` holds blocks for
        every computed token and its newest token is uncomputed, as after ``admit``.
        Capacity (``max_num_seqs``) is the caller's to respect: the KV is already here.
        """
        assert seq.rid not in self.running, seq.rid
        assert seq.num_uncomputed_tokens == 1, seq.num_uncomputed_tokens
        self.running[seq.rid] = _Running(seq, detok_shard)

    def _has_room(self) -> bool:
        # Keep one free block per running request so the batch can grow a step.
        return (
            len(self.running) + len(self.reading) < self.max_num_seqs
            and not self.preempted
            and self.runner.num_free_kv_blocks > len(self.running)
        )

    # ---- one step ----------------------------------------------------------------------

    def step(self) -> DecodeStep:
        """One decode token for every running request (after recomputing preempted ones)."""
        out = DecodeStep()
        batcher = TokenBatcher()
        for t, finish in self._ended:  # no token: the request ends, or is resumed (LOST)
            batcher.add(t.detok_shard, t.rid, len(t.output_ids), -1, 0, float("nan"), finish)
        self._ended = []
        self._resume_preempted()
        batch = self._reserve_blocks()
        sample = None
        if batch:
            seqs = [r.seq for r in batch]
            drafts = self.spec.drafts(seqs) if self.spec is not None else None
            if drafts is not None:
                sample = self._speculative_step(batch, drafts, batcher, out)
            else:
                sample = self.runner.sample(self.runner.decode(seqs), seqs)
                tokens, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
                for i, r in enumerate(batch):
                    self._emit(r, tokens[i], i, logprobs[i], batcher, out)
        out.tokens = batcher.batches(sample)
        return out

    def _speculative_step(
        self,
        batch: list[_Running],
        drafts: list[list[int]],
        batcher: TokenBatcher,
        out: DecodeStep,
    ) -> SampleOutput:
        """Verify every request's drafts in one forward; emit each one's accepted run and
        the token sampled after it, cut at the first token that ends the request."""
        assert self.spec is not None
        seqs = [r.seq for r in batch]
        starts = [seq.num_computed_tokens for seq in seqs]
        v = self.spec.verify(seqs, drafts)
        logprobs = v.sample.logprobs.tolist()
        for r, start, d, tokens, first in zip(batch, starts, drafts, v.tokens, v.first_row):
            m = accepted_run(d, tokens)
            self.spec.record(r.seq, len(d), m)
            if not any(
                self._emit(r, tokens[j], first + j, logprobs[first + j], batcher, out)
                for j in range(m + 1)
            ):
                self.runner.commit_verified(r.seq, start, m)
        return v.sample

    def _emit(
        self, r: _Running, token: int, row: int, logprob: float, batcher: TokenBatcher,
        out: DecodeStep,
    ) -> bool:  # fmt: skip
        """Append ``token`` to ``r``; True if that ended the request (its blocks freed)."""
        r.seq.append_token(token)
        finish = self.runner.check_stop(r.seq)
        pos = len(r.seq.output_ids) - 1
        batcher.add(r.detok_shard, r.seq.rid, pos, token, row, logprob, finish)
        if finish == Finish.NONE:
            return False
        self.runner.free_blocks(r.seq)
        del self.running[r.seq.rid]
        out.finished.append(r.seq.rid)
        if self.spec is not None:
            self.spec.release(r.seq.rid)
        return True

    def _reserve_blocks(self) -> list[_Running]:
        """Every running request gets room for one more token; preempt newest on shortage."""
        batch = list(self.running.values())
        i = 0
        while i < len(batch):
            try:
                self.runner.ensure_blocks(batch[i].seq, 1)
                i += 1
            except NoFreeBlocks:
                victim = batch.pop()  # newest admitted
                self._preempt(victim)
        return batch

    def _preempt(self, r: _Running) -> None:
        logger.info("rid %d: preempted for lack of KV blocks; will recompute", r.seq.rid)
        self.runner.free_blocks(r.seq)
        del self.running[r.seq.rid]
        self.preempted.append(r)

    def _resume_preempted(self) -> None:
        """Recompute KV of preempted requests (all tokens but the newest) when room allows."""
        while self.preempted:
            r = self.preempted[0]
            need = r.seq.blocks_needed(r.seq.num_tokens)  # as if nothing were cached
            if self.runner.num_free_kv_blocks < need + len(self.running):
                return
            self.preempted.popleft()
            self.runner.reuse_prefix(r.seq)
            n = r.seq.num_uncomputed_tokens - 1  # the newest token is decode's
            if n:
                self.runner.prefill([(r.seq, n)])
            self.running[r.seq.rid] = r

    # ---- load --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.pending) + len(self.preempted) + len(self.compiling) + len(self.reading)
