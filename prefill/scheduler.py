"""The prefill scheduler: batched, chunked prefill; first-token sampling; KV export.

One ``PrefillScheduler`` lives in each prefill worker. It knows nothing of rings: the
worker feeds it requests, aborts and KV releases, calls ``step()`` and ships what the
step returns. That keeps it testable in one process.

Request life on a prefill worker:
    add() -> waiting -> first scheduled: the longest cached prefix is reused (prefix
      caching) -> chunks over one or more steps, each publishing the blocks it filled ->
      first token sampled ->
      finished at once (EOS / max_tokens 1): blocks freed, token sent with its finish
      otherwise: blocks pinned, KVTransfer to the decode worker -> release() unpins them
Freed and unpinned blocks that hold a full prefix block stay cached for later requests
until the pool needs the room (engine/kv/block_allocator.py).

A request with a grammar has it compiled on arrival (``grammars.prepare``, on a thread);
its prompt is prefilled meanwhile, all but the last token, whose logits are sampled at
once and so wait for the grammar. A grammar that does not compile ends the request with
an error row (the frontend validated it, so that takes a library mismatch).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.build import Engine
from engine.checkpoint.lora_loader import lora_refusal
from engine.kv.block_allocator import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.sampling.grammar import GrammarError
from engine.sampling.sampler import SampleOutput
from engine.sampling.stops import grammar_ready
from prefill.forks import Forks, PrefillRequest
from runtime.step_output import TokenBatcher
from transport.kv import PinnedBlocks
from transport.worker_load import WorkerLoad
from wire.records import Finish, GenerateRequest, KVTransfer, TokenBatch

logger = logging.getLogger(__name__)

# On CPU, while more than one request waits, a prefill step takes at most this many prompt
# tokens: prompts that arrive together then leave one a step, each first token (and KV
# handoff) not waiting for one forward over the whole burst; at 256 rows a forward's GEMMs
# run at the arithmetic rate of longer ones. Co-located workers apply it to every request
# in (their decode rows wait for each prefill step): measurements in colocated/scheduler.py.
SHARED_CHUNK = 256
LOAD_POLL_S = 0.005  # with nothing to run, how long a step waits on a parked tier-3 load


def fits(engine: Engine, req: GenerateRequest) -> bool:
    """Could ``req`` ever run here (max_model_len, the whole KV pool)? Logs when not."""
    total = len(req.prompt_ids) + len(req.output_ids) + 1  # + the token it will sample
    blocks = -(-total // engine.kv.block_size)
    if total > engine.stops.max_model_len or blocks > engine.kv.num_blocks:
        logger.error("rid %d: %d tokens can never fit; rejected", req.rid, total)
        return False
    why = lora_refusal(engine.loras, req.sampling.lora)
    if why is not None:
        logger.error("rid %d: its LoRA adapter cannot run: %s", req.rid, why)
        return False
    return True


@dataclass
class Intake:
    """The requests a worker took off its request ring, cumulative over its generation
    (the router compares them with what it sent to know what is still in flight)."""

    engine: Engine
    requests: int = 0
    prompt_tokens: int = 0

    def take(self, req: GenerateRequest) -> bool:
        """Count ``req`` in; False if it can never run on this worker (see ``fits``)."""
        self.requests += 1
        self.prompt_tokens += len(req.prompt_ids)
        return fits(self.engine, req)

    def load(self, queued_tokens: int, waiting: int, running: int, computed: int) -> WorkerLoad:
        """The worker's queue figures for its load-table row, these counts among them."""
        return WorkerLoad(
            queued_prefill_tokens=queued_tokens,
            waiting_requests=waiting,
            running_requests=running,
            requests_received=self.requests,
            prompt_tokens_received=self.prompt_tokens,
            computed_prefill_tokens=computed,
        )


@dataclass
class PrefillStep:
    """What one step produced: tokens per detokenizer shard, KV handoffs per decode worker."""

    tokens: dict[int, TokenBatch] = field(default_factory=dict)
    transfers: list[tuple[int, KVTransfer]] = field(default_factory=list)
    ran_tokens: int = 0
    # keep_kv only: (sequence, detok shard) whose KV stays where it is, unpinned, for a
    # decode scheduler on the same runner to adopt (co-located workers).
    handovers: list[tuple[Sequence, int]] = field(default_factory=list)
    # rid -> prompt tokens whose KV was reused from the prefix cache, for every request
    # whose first token is in ``tokens`` (OpenAI usage.prompt_tokens_details.cached_tokens).
    cached_tokens: dict[int, int] = field(default_factory=dict)


class PrefillScheduler:
    def __init__(
        self, engine: Engine, worker_index: int, chunk_budget: int, keep_kv: bool = False
    ) -> None:
        # The runner runs the forwards and samples; the blocks are the pool's (``kv``).
        self.runner, self.kv, self.grammars = engine.runner, engine.kv, engine.grammars
        self.stops = engine.stops
        self.keep_kv = keep_kv
        # keep_kv: requests another worker decodes (their ``decode_worker`` is not this
        # worker's index) are exported all the same (``launch --workers``).
        self.exports = False
        self.index = worker_index
        self.chunk_budget = chunk_budget
        # A step's budget while others share the worker (``plan(shared=True)``).
        cpu = engine.runner.device.type == "cpu"
        self.shared_budget = min(chunk_budget, SHARED_CHUNK) if cpu else chunk_budget
        self.waiting: deque[PrefillRequest] = deque()
        self.pinned = PinnedBlocks()
        self._failed: list[PrefillRequest] = []  # dropped this step: their grammar failed
        self.forks = Forks()
        self.computed_tokens = 0  # prompt tokens run through the model, cumulative
        self.intake = Intake(engine)

    # ---- inputs ------------------------------------------------------------------------

    def add(self, req: GenerateRequest) -> Finish:
        """Queue a request; returns ``Finish.ERROR`` (not queued) if it can never run."""
        if not self.intake.take(req):
            return Finish.ERROR
        seq = Sequence(
            rid=req.rid,
            prompt_ids=list(req.prompt_ids),
            sampling=req.sampling,
            output_ids=list(req.output_ids),
            block_size=self.runner.block_size,
        )
        if req.sampling.grammar is not None:
            self.grammars.prepare(req.sampling.grammar)
        p = PrefillRequest(seq, req.decode_worker, req.detok_shard)
        if req.fork_of < 0 or not self.forks.join(req, p):
            self.waiting.append(p)
            self.forks.lead(p, req)
        return Finish.NONE

    def abort(self, rid: int) -> None:
        """Drop ``rid`` if it is still waiting or mid-prefill; pinned KV waits for release."""
        for p in list(self.waiting):
            if p.seq.rid == rid:
                self.waiting.remove(p)
                self.kv.free_blocks(p.seq)
        self.waiting.extend(self.forks.abort(rid))  # a leader's forks go on alone

    def preempt_newest(self) -> bool:
        """Free the blocks of the newest partly prefilled request; it stays queued and is
        recomputed from its start later. False if no waiting request holds blocks.

        For a runner shared with decode (co-located), where partial prefills can hold every
        block while none of them can grow.
        """
        for p in reversed(self.waiting):
            if p.seq.block_table:
                logger.info("rid %d: prefill preempted, KV blocks exhausted", p.seq.rid)
                self.kv.free_blocks(p.seq)
                return True
        return False

    def release(self, rid: int) -> None:
        """Decode no longer needs ``rid``'s pinned blocks."""
        self.kv.unpin(self.pinned.on_release(rid))

    def decode_worker_died(self, decode_worker: int) -> None:
        self.kv.unpin(self.pinned.on_peer_dead(decode_worker))

    # ---- one step ----------------------------------------------------------------------

    def step(self) -> PrefillStep:
        """Run one batched prefill over as many waiting chunks as the budget and KV allow
        (on CPU at most ``SHARED_CHUNK`` tokens while more than one request waits)."""
        chunks = self.plan(shared=len(self.waiting) > 1)
        logits = self.runner.prefill([(p.seq, n) for p, n in chunks]) if chunks else None
        return self.finish(chunks, logits)

    def plan(self, shared: bool = False) -> list[tuple[PrefillRequest, int]]:
        """``step``'s first half: this step's chunks, their KV blocks reserved, within the
        chunk budget (``shared``, other requests in the worker: ``shared_budget``). The
        caller runs them (``runner.prefill``, or one forward with other rows: the co-located
        scheduler's decode batch) and hands their logits to ``finish``."""
        return self._plan(self.shared_budget if shared else self.chunk_budget)

    def finish(
        self, chunks: list[tuple[PrefillRequest, int]], logits: torch.Tensor | None
    ) -> PrefillStep:
        """``step``'s second half: ``logits`` (len(chunks), vocab), each chunk's last row,
        from the forward that ran ``plan``'s chunks (None when there were none)."""
        out = PrefillStep()
        batcher = TokenBatcher()
        for p in self._failed:  # an error row: no token, the request ends
            batcher.end(p.detok_shard, p.seq.rid, len(p.seq.output_ids), Finish.ERROR)
        self._failed = []
        sample = None
        if chunks:
            assert logits is not None and logits.shape[0] == len(chunks), "one row a chunk"
            out.ran_tokens = sum(n for _, n in chunks)
            self.computed_tokens += out.ran_tokens
            done = [
                (row, p) for row, (p, _) in enumerate(chunks) if p.seq.num_uncomputed_tokens == 0
            ]
            if done:
                sample = self._sample_done(logits, done, batcher, out)
        elif not self.keep_kv:  # nothing ran: a parked load is worth a short wait, no spin
            self.wait_for_loads()
        out.tokens = batcher.batches(sample)
        return out

    @property
    def loading(self) -> bool:
        """Is a waiting request parked on tier reads still in flight (``KVPool.reuse_prefix``)?
        Reads that are done do not count: the next ``_plan`` settles them."""
        return any(self.kv.tier_load_pending(p.seq) for p in self.waiting)

    def wait_for_loads(self, timeout_s: float = LOAD_POLL_S) -> None:
        """Sleep until a parked request's reads are done (at most ``timeout_s``)."""
        self.kv.wait_tier_loads([p.seq for p in self.waiting], timeout_s)

    def _sample_done(
        self,
        logits: torch.Tensor,
        done: list[tuple[int, PrefillRequest]],
        batcher: TokenBatcher,
        out: PrefillStep,
    ) -> SampleOutput:
        """First tokens of the requests whose prompt is computed (and of their forks, from
        the same logits row); their KV goes on."""
        for _, p in done:
            self.waiting.remove(p)
        done = self._with_forks(done)
        rows = [row for row, _ in done]
        sample = self.runner.sample(logits[rows], [p.seq for _, p in done])
        tokens, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
        for i, (_, p) in enumerate(done):
            cached = p.seq.num_cached_tokens
            finish = batcher.emit(
                p.seq, p.detok_shard, tokens[i], i, logprobs[i], self.stops.check, cached
            )
            out.cached_tokens[p.seq.rid] = cached
            if finish != Finish.NONE:
                self.kv.free_blocks(p.seq)
            elif self.keep_kv and not (self.exports and p.decode_worker != self.index):
                out.handovers.append((p.seq, p.detok_shard))
            else:
                out.transfers.append((p.decode_worker, self._export(p)))
        return sample

    def _with_forks(
        self, done: list[tuple[int, PrefillRequest]]
    ) -> list[tuple[int, PrefillRequest]]:
        """``done`` plus each leader's forks on the leader's row, given its prompt's KV."""
        out = []
        for row, p in done:
            out.append((row, p))
            for f in self.forks.take(p):
                try:
                    # Co-located decode writes its next token into the prompt's last
                    # block: each fork needs its own copy of it there.
                    self.kv.fork(p.seq, f.seq, copy_tail=self.keep_kv)
                except NoFreeBlocks:
                    self.waiting.append(f)  # it computes its prompt itself, later
                    continue
                out.append((row, f))
        return out

    def _plan(self, budget: int) -> list[tuple[PrefillRequest, int]]:
        """FCFS chunks within the token budget. Past the first request KV cannot hold, no
        new request starts; those already holding blocks may still take a chunk (finishing
        them frees blocks), and parked requests whose reads are done are settled.

        NOTE: a request skipped while parked lets later ones take blocks ahead of it; once
        settled it may find none. Were the scan to stop there, the later ones could never
        finish and a parked request past it never settle: ``loading`` would stay true and
        the co-located scheduler would wait on reads that are done instead of preempting.
        """
        chunks, full = [], False
        for p in list(self.waiting):
            if budget <= 0:
                break
            if full and not p.seq.block_table and not self.kv.tier_loading(p.seq):
                continue
            ready = self._grammar_ready(p)
            if ready is None:
                continue
            ready = self._forks_ready(p) and ready
            # No-op unless this is its first chunk. A request whose prefix is read from
            # the disk tier stays parked (the others step on) until its reads are done.
            self.kv.reuse_prefix(p.seq, wait=False)
            if self.kv.tier_loading(p.seq):
                continue
            n = min(p.seq.num_uncomputed_tokens, budget)
            if not ready and n == p.seq.num_uncomputed_tokens:
                # The last token's logits are sampled at once: that waits for the grammar
                # and for the forks that share them.
                n -= 1
            if n == 0:
                continue
            try:
                self.kv.ensure_blocks(p.seq, n)
            except NoFreeBlocks:
                full = True  # back-pressure: the load table shows free blocks at zero
                continue
            chunks.append((p, n))
            budget -= n
        return chunks

    def _grammar_ready(self, p: PrefillRequest, fork: bool = False) -> bool | None:
        """Is ``p``'s grammar (if any) compiled; None: it failed, ``p`` is dropped."""
        try:
            return grammar_ready(self.grammars, p.seq)
        except GrammarError as e:
            logger.error("rid %d: its grammar does not compile: %s", p.seq.rid, e)
            if fork:
                self.forks.abort(p.seq.rid)
            else:
                self.waiting.remove(p)
                self.waiting.extend(self.forks.abort(p.seq.rid))
            self.kv.free_blocks(p.seq)
            self._failed.append(p)
            return None

    def _forks_ready(self, leader: PrefillRequest) -> bool:
        """Are ``leader``'s forks all in, with their grammars compiled?"""
        if self.forks.holds_back(leader):
            return False
        ready = [self._grammar_ready(f, fork=True) for f in list(self.forks.of(leader))]
        return all(r is not False for r in ready)

    def _export(self, p: PrefillRequest) -> KVTransfer:
        seq = p.seq
        # NOTE: the newest token has no KV yet; decode computes it in its first step.
        blocks = list(seq.block_table)
        self.kv.pin(blocks)
        self.pinned.pin(seq.rid, p.decode_worker, blocks)
        # Prefix caching: the hashes of the full blocks (already computed when they were
        # published), so decode finds the blocks it holds without rehashing the prompt.
        bs = self.runner.block_size
        hashes = (
            seq.full_block_hashes(seq.num_computed_tokens // bs)
            if self.runner.config.enable_prefix_caching
            else []
        )
        return KVTransfer(
            rid=seq.rid,
            prefill_worker=self.index,
            src_blocks=blocks,
            num_tokens=seq.num_computed_tokens,
            prompt_ids=seq.prompt_ids,
            output_ids=seq.output_ids,
            sampling=seq.sampling,
            detok_shard=p.detok_shard,
            block_hashes=hashes,
        )

    # ---- load --------------------------------------------------------------------------

    @property
    def queued_tokens(self) -> int:
        return sum(p.seq.num_uncomputed_tokens for p in self.waiting)

    def load(self) -> WorkerLoad:
        return self.intake.load(self.queued_tokens, self.num_waiting, 0, self.computed_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.forks.num_forks
