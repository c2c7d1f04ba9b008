"""The co-located scheduler: one runner, prefill and decode of the same requests.

The baseline that disaggregation is measured against, and the one scheduling loop of
co-located serving: ``launch --colocated`` workers and the in-process ``LLM``
(``colocated/llm.py``) both drive it. It composes the two existing
schedulers over one ``ModelRunner`` (one model, one KV pool) instead of re-implementing
them: a request's prefill ends with its blocks handed straight to the decode scheduler
(``PrefillScheduler(keep_kv=True)`` -> ``DecodeScheduler.adopt``), so there is no pin, no
copy and no release.

Each ``step()`` is a mixed schedule, as a co-located engine runs it:
    admit queued requests while running + prefilling < max_num_seqs
    -> plan the prefill chunks (the chunk budget; on CPU at most ``SHARED_CHUNK``
       while other requests are in; their blocks reserved) and run them
    -> first tokens of finished prefills, which join the running batch
    -> one decode row per running request (those that just joined included)
With ``EngineConfig.mixed_batches`` (``--mixed-batches``) the chunks and the decode rows
share one forward, which reads the weights once for both; off (the default), the chunks'
forward runs first, then the decode rows' own. Mixed, the decode rows run the many-rows
GEMM that prefill chunks take, not the packed kernel a decode step of as many rows would,
so their tokens may differ in the last bits from a step without a chunk. On a 2-core Zen 5
the GEMMs are bound by arithmetic at these row counts, so sharing the weight reads saves
little, while a newcomer's first token waits for the decode rows' share of the forward:
under Poisson load it measured no faster (``benchmarks/results/mixed_batches.md``). A
speculative step (drafts to verify) keeps its own forward, the chunk's after it. A long
chunk lengthens the step its decode rows wait for either way: the interference
disaggregation removes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from decode.admission import Releases
from decode.scheduler import DecodeScheduler
from engine.build import Engine
from engine.kv.sequence import Sequence
from prefill.forks import PrefillRequest
from prefill.scheduler import Intake, PrefillScheduler, PrefillStep
from transport.errors import KVTransferError
from transport.kv import KVReceiver
from transport.worker_load import WorkerLoad
from wire.records import Finish, GenerateRequest, KVTransfer, TokenBatch

logger = logging.getLogger(__name__)

# On CPU, while more than one request is in the worker (decoding, prefilling or queued), a
# step takes at most SHARED_CHUNK prompt tokens (prefill/scheduler.py); a request alone
# takes the whole budget. Each prefill step stalls every running request, so short chunks
# keep them moving and start newcomers sooner; and prompts that arrive together, prefilled
# in one step, would decode in lockstep, end together and (under a closed loop) come back
# together, each wave's first tokens waiting for all its prompts. A step a prompt (at 256
# tokens) staggers them. On a 2-core Zen 5, 256-token prompts, closed loop
# (benchmarks/results/chunk_budget.md), against the whole budget below 24 requests and 512
# from there: TTFT p50 0.27x / 0.23x / 0.55x at 8 / 16 / 32 streams, throughput
# 1.00-1.08x, TPOT p50 1.67x / 1.37x / 1.05x. A GPU's prefill wants its long chunks: not
# there. The in-process ``LLM`` follows the same rule.


class NoKVTransfers(KVReceiver):
    """The decode half of a co-located worker never imports KV: every fetch is refused."""

    def fetch(self, src_worker: int, src_blocks: Seq[int], dst_blocks: Seq[int]) -> None:
        raise KVTransferError("a co-located worker takes no KV transfers")


@dataclass
class ColocatedStep:
    """Token batches per detokenizer shard, prefill's first (they are lower positions),
    except those ``step``'s ``emit`` took."""

    tokens: list[tuple[int, TokenBatch]] = field(default_factory=list)
    # ``receiver`` given (``launch --workers``): KV handoffs to other workers' decode, per
    # worker (the prefill worker's ``PrefillStep.transfers``).
    transfers: list[tuple[int, KVTransfer]] = field(default_factory=list)
    ran_prefill_tokens: int = 0
    decoded: int = 0  # requests that got a decode token this step


class ColocatedScheduler:
    def __init__(
        self,
        engine: Engine,
        worker_index: int,
        chunk_budget: int,
        max_num_seqs: int,
        receiver: KVReceiver | None = None,
    ) -> None:
        """``receiver``: this worker also hands KV off and adopts handoffs (``launch
        --workers``): a request whose ``decode_worker`` is another worker is exported
        after its prefill (``ColocatedStep.transfers``), and ``offer``/``admit`` take
        other workers' handoffs through ``receiver``."""
        self.runner = runner = engine.runner
        self.max_num_seqs = max_num_seqs
        self.prefill = PrefillScheduler(engine, worker_index, chunk_budget, keep_kv=True)
        self.decode = DecodeScheduler(engine, receiver or NoKVTransfers(), max_num_seqs)
        self.prefill.exports = receiver is not None
        self.releases: Releases = []  # owed to other workers' prefill (aborted handoffs)
        # Accepted requests not yet given to prefill: holding them here bounds the batch,
        # because an adopted request cannot be refused (its KV is already in place).
        self.queued: deque[GenerateRequest] = deque()
        self.intake = Intake(engine)
        # One forward for a step's prefill chunks and decode rows (see the module's note).
        self.mixed = runner.config.mixed_batches and runner.mixes_batches

    # ---- inputs ------------------------------------------------------------------------

    def add(self, req: GenerateRequest) -> Finish:
        """Queue a request; ``Finish.ERROR`` (not queued) if it can never fit this worker."""
        if not self.intake.take(req):
            return Finish.ERROR
        self.queued.append(req)
        return Finish.NONE

    def abort(self, rid: int) -> None:
        """Stop ``rid`` wherever it is; its blocks are free when this returns."""
        self.queued = deque(r for r in self.queued if r.rid != rid)
        self.prefill.abort(rid)
        self.releases += self.decode.abort(rid)

    def admit(self) -> Releases:
        """Adopt other workers' pending handoffs while the batch has room, counting the
        prefills here that will join it; the releases owed for them (``launch --workers``)."""
        d = self.decode

        def room() -> bool:
            held = d.num_running + len(d.admission.reading) + self.prefill.num_waiting
            return d._has_room() and held < self.max_num_seqs

        admitted, releases = d.admission.admit(room)
        for seq, t in admitted:
            d.adopt(seq, t.detok_shard)
        return releases

    # ---- one step ----------------------------------------------------------------------

    def step(self, emit: Callable[[int, TokenBatch], None] | None = None) -> ColocatedStep:
        """The prefill chunks' forward, then the running batch's decode forward (mixed
        batches: one forward for both). ``emit(shard, batch)``: takes the prefill's
        first tokens as soon as they are sampled, so a new request's first token does not
        wait for the decode tokens' bookkeeping (or, unmixed, for the decode forward: at
        32 rows, ~40 ms on a 2-core CPU); without it they come back in ``tokens``, ahead of
        the decode's."""
        self._feed_prefill()
        out = ColocatedStep()
        chunks = self.prefill.plan(shared=self.num_running + self.num_waiting > 1)
        spans = [(p.seq, n) for p, n in chunks]
        dec, pre = None, None
        if chunks and self.mixed:
            done: list[PrefillStep] = []

            def with_chunks(seqs: list[Sequence]) -> torch.Tensor:
                # Each decode row: its newest token, the one uncomputed, as a chunk of one.
                logits = self.runner.prefill(spans + [(seq, 1) for seq in seqs])
                # First tokens sampled and sent before the decode rows are.
                done.append(self._finish_prefill(chunks, logits[: len(spans)], out, emit))
                return logits[len(spans) :]

            out.decoded = len(self.decode.running)
            dec = self.decode.step(with_chunks)
            # Empty when no decode forward ran (no running request, or a speculative one).
            pre = done[0] if done else None
        if pre is None:
            logits = self.runner.prefill(spans) if chunks else None
            pre = self._finish_prefill(chunks, logits, out, emit)
        for seq, shard in pre.handovers:  # in this step's decode forward, unless it ran
            self.decode.adopt(seq, shard)
        if dec is None:
            out.decoded = len(self.decode.running)
            dec = self.decode.step()
        out.tokens += dec.tokens.items()
        if not pre.ran_tokens and not dec.tokens and self.prefill.loading:
            self.prefill.wait_for_loads()  # its reads end soon: no spin, no preemption
        elif not pre.ran_tokens and not dec.tokens and self.has_work:
            # Nothing could run: partial prefills hold every block and none can grow (or
            # decode waits to resume). The newest gives its blocks back and starts over.
            self.prefill.preempt_newest()
        return out

    def _finish_prefill(
        self,
        chunks: list[tuple[PrefillRequest, int]],
        logits: torch.Tensor | None,
        out: ColocatedStep,
        emit: Callable[[int, TokenBatch], None] | None,
    ) -> PrefillStep:
        pre = self.prefill.finish(chunks, logits)
        out.ran_prefill_tokens = pre.ran_tokens
        out.transfers += pre.transfers
        if emit is None:
            out.tokens += pre.tokens.items()
        else:
            for shard, batch in pre.tokens.items():
                emit(shard, batch)
        return pre

    def _feed_prefill(self) -> None:
        # NOTE: nothing new starts while decode has preempted requests, so freed blocks go
        # to resuming them first (as DecodeScheduler's own admission does).
        while (
            self.queued
            and not self.decode.preempted
            and self.num_running + self.prefill.num_waiting < self.max_num_seqs
        ):
            verdict = self.prefill.add(self.queued.popleft())
            assert verdict == Finish.NONE, "add() already checked that it fits"

    # ---- load --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(
            self.queued
            or self.prefill.waiting
            or self.decode.running
            or self.decode.preempted
            or self.decode.admission.compiling
        )

    @property
    def queued_tokens(self) -> int:
        queued = sum(len(r.prompt_ids) + len(r.output_ids) for r in self.queued)
        return queued + self.prefill.queued_tokens

    @property
    def shared_budget(self) -> int:
        """A step's prompt tokens while more than one request is in (``SHARED_CHUNK``)."""
        return self.prefill.shared_budget

    @property
    def num_running(self) -> int:
        return self.decode.num_running

    def load(self) -> WorkerLoad:
        computed = self.prefill.computed_tokens
        return self.intake.load(self.queued_tokens, self.num_waiting, self.num_running, computed)

    @property
    def num_waiting(self) -> int:
        handoffs = self.decode.admission.num_waiting  # launch --workers: KV to adopt
        return len(self.queued) + self.prefill.num_waiting + len(self.decode.preempted) + handoffs
