"""The decode scheduler: continuous batching over the requests admission hands it.

One ``DecodeScheduler`` lives in each decode worker. The worker feeds it ``KVTransfer``
offers and aborts, calls ``admit()`` and ``step()``, and ships what they return. Its
I/O is admission's alone (``decode/admission.py``: KV copies started and polled, never
waited on); the batch itself runs only the model.

A decode request's life (admission's states first, then the batch's):
    COMPILING -> PENDING -> READING -> admitted      (decode/admission.py; or ENDED)
    RUNNING: one token per step, every running request in every step (with
      speculation, engine/speculative/: a verified run of drafts and one more token)
      -> finished (EOS, stop token, length) or aborted: blocks freed the same step
    PREEMPTED: a running request whose next block cannot be had; its blocks are freed and
      it is recomputed here (one prefill over prompt + output) when room returns. It
      never goes back to a prefill worker, and its output so far is kept. With prefix
      caching, imported and generated blocks are published as they fill, so a preempted
      request reuses whichever of its blocks were not evicted meanwhile.
A handoff whose grammar was compiled here (COMPILING) has its matcher rebuilt by
replaying the request's output so far when it is first sampled here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decode.admission import Admission, Releases
from engine.build import Engine
from engine.kv.block_allocator import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.sampling.sampler import SampleOutput
from engine.speculative.speculator import Speculator
from engine.speculative.verify import accepted_run
from runtime.step_output import TokenBatcher
from transport.kv import KVReceiver
from wire.records import Finish, KVTransfer, TokenBatch

logger = logging.getLogger(__name__)


@dataclass
class _Running:
    seq: Sequence
    detok_shard: int


@dataclass
class DecodeStep:
    tokens: dict[int, TokenBatch] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)


class DecodeScheduler:
    def __init__(self, engine: Engine, receiver: KVReceiver, max_num_seqs: int) -> None:
        # The runner runs the forwards and samples; the blocks are the pool's (``kv``).
        self.runner, self.kv, self.stops = engine.runner, engine.kv, engine.stops
        self.max_num_seqs = max_num_seqs
        self.admission = Admission(engine, receiver)
        self.running: dict[int, _Running] = {}
        self.preempted: deque[_Running] = deque()
        config = engine.config.speculative
        self.speculator = Speculator(engine, config) if config is not None else None

    # ---- inputs ------------------------------------------------------------------------

    def offer(self, t: KVTransfer) -> Releases:
        """A prefill worker has KV ready for ``t.rid`` (see ``Admission.offer``)."""
        return self.admission.offer(t)

    def abort(self, rid: int) -> Releases:
        """Stop ``rid`` wherever it is here; its blocks are free when this returns, but
        those of a read still in flight, freed once it has ended (DRAINING)."""
        releases = self.admission.abort(rid)
        self.preempted = deque(r for r in self.preempted if r.seq.rid != rid)
        r = self.running.pop(rid, None)
        if r is not None:
            self.kv.free_blocks(r.seq)
        if self.speculator is not None:
            self.speculator.release(rid)
        return releases

    def admit(self) -> Releases:
        """Admit pending handoffs while the batch has room; returns releases for prefill."""
        admitted, releases = self.admission.admit(self._has_room)
        for seq, t in admitted:
            self.running[t.rid] = _Running(seq, t.detok_shard)
        return releases

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
            len(self.running) + len(self.admission.reading) < self.max_num_seqs
            and not self.preempted
            and self.kv.num_free_blocks > len(self.running)
        )

    # ---- one step ----------------------------------------------------------------------

    def step(self, forward: Callable[[list[Sequence]], torch.Tensor] | None = None) -> DecodeStep:
        """One decode token for every running request (after recomputing preempted ones).

        ``forward(seqs)``: runs the batch's decode forward instead of ``runner.decode``
        (the co-located scheduler's, which runs it inside a prefill chunk's forward) and
        returns its logits (len(seqs), vocab). Not called for a speculative step."""
        out = DecodeStep()
        batcher = TokenBatcher()
        for t, finish in self.admission.take_ended():  # ended (or handed back) without a token
            batcher.end(t.detok_shard, t.rid, len(t.output_ids), finish)
        self._resume_preempted()
        batch = self._reserve_blocks()
        sample = None
        if batch:
            seqs = [r.seq for r in batch]
            drafts = self.speculator.drafts(seqs) if self.speculator is not None else None
            began = time.perf_counter()
            if drafts is not None:
                sample = self._speculative_step(batch, drafts, batcher, out)
            else:
                logits = (forward or self.runner.decode)(seqs)
                sample = self.runner.sample(logits, seqs)
                tokens, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
                for i, r in enumerate(batch):
                    self._emit(r, tokens[i], i, logprobs[i], batcher, out)
            if (
                self.speculator is not None
            ):  # the cost-aware gate's clock (engine/speculative/cost.py)
                x = sum(map(len, drafts)) if drafts is not None else 0
                self.speculator.timed(len(batch), x, time.perf_counter() - began)
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
        assert self.speculator is not None
        seqs = [r.seq for r in batch]
        starts = [seq.num_computed_tokens for seq in seqs]
        v = self.speculator.verify(seqs, drafts)
        logprobs = v.sample.logprobs.tolist()
        for r, start, d, tokens, first in zip(batch, starts, drafts, v.tokens, v.first_row):
            m = accepted_run(d, tokens)
            self.speculator.record(r.seq, len(d), m)
            # The step's first row says how many drafts were verified; each row whether
            # its token is an accepted draft (row m, sampled after the run, is not).
            if not any(
                self._emit(
                    r,
                    tokens[j],
                    first + j,
                    logprobs[first + j],
                    batcher,
                    out,
                    len(d) if j == 0 else 0,
                    j < m,
                )
                for j in range(m + 1)
            ):
                self.runner.commit_verified(r.seq, start, m)
        return v.sample

    def _emit(
        self,
        r: _Running,
        token: int,
        row: int,
        logprob: float,
        batcher: TokenBatcher,
        out: DecodeStep,
        drafted: int = 0,
        accepted: bool = False,
    ) -> bool:
        """Append ``token`` to ``r``; True if that ended the request (its blocks freed).
        ``drafted`` goes on a speculative step's first row only (``TokenBatch.drafted``)."""
        check = self.stops.check
        finish = batcher.emit(
            r.seq, r.detok_shard, token, row, logprob, check, drafted=drafted, accepted=accepted
        )
        if finish == Finish.NONE:
            return False
        self.kv.free_blocks(r.seq)
        del self.running[r.seq.rid]
        out.finished.append(r.seq.rid)
        if self.speculator is not None:
            self.speculator.release(r.seq.rid)
        return True

    def _reserve_blocks(self) -> list[_Running]:
        """Every running request gets room for one more token; preempt newest on shortage."""
        batch = list(self.running.values())
        i = 0
        while i < len(batch):
            try:
                self.kv.ensure_blocks(batch[i].seq, 1)
                i += 1
            except NoFreeBlocks:
                victim = batch.pop()  # newest admitted
                self._preempt(victim)
        return batch

    def _preempt(self, r: _Running) -> None:
        logger.info("rid %d: preempted for lack of KV blocks; will recompute", r.seq.rid)
        self.kv.free_blocks(r.seq)
        del self.running[r.seq.rid]
        self.preempted.append(r)

    def _resume_preempted(self) -> None:
        """Recompute KV of preempted requests (all tokens but the newest) when room allows."""
        while self.preempted:
            r = self.preempted[0]
            need = r.seq.blocks_needed(r.seq.num_tokens)  # as if nothing were cached
            if self.kv.num_free_blocks < need + len(self.running):
                return
            self.preempted.popleft()
            self.kv.reuse_prefix(r.seq)
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
        return self.admission.num_waiting + len(self.preempted)
