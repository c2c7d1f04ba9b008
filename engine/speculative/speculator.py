"""The decode worker's speculation: who speculates this step, with how many drafts.

Who calls what (the decode scheduler, each step, with the running batch):
    drafts(seqs)        -> per sequence its drafts (blocks for them reserved), or None:
                           this step decodes one token per request as usual
    verify(seqs, d)     -> the target's samples at every drafted position
    record(seq, n, m)   after the scheduler emitted a request's accepted run: n drafted,
                        m accepted; updates that request's measured acceptance
    timed(b, x, s)      the step (forward and sampling) of b requests with x drafts took
                        s seconds: the cost model's measurements
    release(rid)        the request left this worker

Aiming at no loss: a step with more than ``disable_by_batch_size`` requests running
does not speculate; below that, the cost-aware gate (engine/speculative/cost.py) gives each
request the drafts that maximise the step's expected tokens per measured second, none
when verifying would not pay. Requests that do not speculate in a step are counted by
reason (``SpeculationStats.skipped``; ``low_acceptance``: the gate found its expected accepted
tokens not worth the measured cost of verifying them), never refused: they decode one
token, as without speculation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.build import Engine
from engine.config import SpeculativeConfig
from engine.errors import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.speculative.cost import Acceptance, Prior, StepTimes, allocate
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Proposer
from engine.speculative.verify import Verified, grammar_drafts, sample_rows


@dataclass
class SpeculationStats:
    """Counters since the worker started (vLLM's names, in engine terms)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: draft j+1 accepted
    skipped: Counter[str] = field(default_factory=Counter)  # request-steps, by reason


@dataclass
class _Req:
    acc: Acceptance
    drafted: int = 0  # per-request totals (reported to the client on opt-in)
    accepted: int = 0


class Speculator:
    def __init__(
        self, engine: Engine, config: SpeculativeConfig, proposer: Proposer | None = None
    ) -> None:
        self.runner, self.kv, self.grammars = engine.runner, engine.kv, engine.grammars
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(engine, config)
        k = config.num_speculative_tokens
        self.stats = SpeculationStats(accepted_per_pos=[0] * k)
        self._reqs: dict[int, _Req] = {}
        # The cost-aware gate's measurements; None: every request verifies all the drafts
        # it is offered (``adaptive`` off; tests forcing drafts through a stub proposer).
        self.times: StepTimes | None = StepTimes() if config.adaptive else None
        self._prior: Prior = [None] * k  # worker-wide per-position acceptance

    def drafts(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """This step's drafts per sequence (some may be empty), or None: no speculation."""
        if len(seqs) > self.config.disable_by_batch_size:
            self.stats.skipped["batch_size"] += len(seqs)
            return None
        reqs = [self._req(seq) for seq in seqs]
        ks = [self._room(seq) for seq in seqs]
        gated = self.times is not None
        if gated and not self.proposer.cheap:  # decide before paying for the drafts
            ks = self._allocate(seqs, reqs, [[0] * k for k in ks])
        out: list[list[int]] = [[] for _ in seqs]
        asked = [i for i, k in enumerate(ks) if k > 0]
        if asked:
            proposed = self.proposer.propose([seqs[i] for i in asked], [ks[i] for i in asked])
            for i, d in zip(asked, proposed, strict=True):
                out[i] = list(d[: ks[i]])
                if not out[i]:
                    self.stats.skipped["no_draft"] += 1
        grammar_drafts(self.grammars, seqs, out)
        if gated and self.proposer.cheap:
            self._gate(seqs, reqs, out)
        for seq, d in zip(seqs, out, strict=True):
            if d and not self._reserve(seq, len(d)):
                d.clear()
        return out if any(out) else None

    def _gate(self, seqs: list[Sequence], reqs: list[_Req], out: list[list[int]]) -> None:
        """Cut each request's drafts to what the cost model says pays; a request left
        with none keeps its proposal as shadow drafts (scored as it decodes)."""
        for seq, r in zip(seqs, reqs, strict=True):
            r.acc.check_shadow(seq.output_ids, self._prior, final=False)
        ks = self._allocate(seqs, reqs, out)
        for seq, r, d, k in zip(seqs, reqs, out, ks, strict=True):
            if k > 0:
                r.acc.check_shadow(seq.output_ids, self._prior, final=True)
            elif d:
                self.stats.skipped["low_acceptance"] += 1
                if not r.acc.shadow:
                    r.acc.shadow, r.acc.shadow_base = list(d), len(seq.output_ids)
            del d[k:]

    def _allocate(self, seqs: list[Sequence], reqs: list[_Req], out: list[list[int]]) -> list[int]:
        assert self.times is not None
        gains = [r.acc.gains(len(d), self._prior) for r, d in zip(reqs, out, strict=True)]
        return allocate(gains, len(seqs), self.times)

    def _req(self, seq: Sequence) -> _Req:
        r = self._reqs.get(seq.rid)
        if r is None:
            r = self._reqs[seq.rid] = _Req(Acceptance([None] * len(self._prior)))
        return r

    def _room(self, seq: Sequence) -> int:
        """How many drafts ``seq`` may verify at most (0: none): positions up to
        max_model_len, and no draft past max_tokens (the token sampled after the last
        draft is the last one a step can emit)."""
        room = min(
            self.runner.max_model_len - seq.num_tokens,
            seq.sampling.max_tokens - len(seq.output_ids) - 1,
        )
        if room <= 0:
            self.stats.skipped["length"] += 1
            return 0
        return min(self.config.num_speculative_tokens, room)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        try:
            self.kv.ensure_blocks(seq, n + 1)
        except NoFreeBlocks:
            self.stats.skipped["no_kv_blocks"] += 1
            return False
        return True

    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> Verified:
        logits = self.runner.verify(seqs, drafts)
        return sample_rows(logits, seqs, drafts, self.grammars, self.runner.generator)

    def timed(self, b: int, x: int, seconds: float) -> None:
        """A step of ``b`` requests verifying ``x`` drafts in all took ``seconds``."""
        if self.times is not None:
            self.times.observe(b, x, seconds)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """``seq`` verified ``drafted`` drafts this step and ``accepted`` of them held."""
        if not drafted:
            return
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted
        for j in range(accepted):
            st.accepted_per_pos[j] += 1
        r = self._reqs[seq.rid]
        r.drafted += drafted
        r.accepted += accepted
        r.acc.observe(drafted, accepted, self._prior)

    def counts(self, rid: int) -> tuple[int, int]:
        """(drafted, accepted) tokens of ``rid`` so far on this worker."""
        r = self._reqs.get(rid)
        return (r.drafted, r.accepted) if r is not None else (0, 0)

    def release(self, rid: int) -> None:
        self._reqs.pop(rid, None)
        self.proposer.release(rid)


def make_proposer(engine: Engine, config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from engine.speculative.draft_model import DraftModelProposer

    assert config.model is not None
    return DraftModelProposer(engine.runner, config.model)
