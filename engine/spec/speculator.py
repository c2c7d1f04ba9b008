"""The decode worker's speculation: who speculates this step, with how many drafts.

Who calls what (the decode scheduler, each step, with the running batch):
    drafts(seqs)        -> per sequence its drafts (blocks for them reserved), or None:
                           this step decodes one token per request as usual
    verify(seqs, d)     -> the target's samples at every drafted position
    record(seq, n, m)   after the scheduler emitted a request's accepted run: n drafted,
                        m accepted; adapts that request's k and its gate
    release(rid)        the request left this worker

Aiming at no loss (benchmarks/results/speculative.md shows where it still loses): a
step with more than ``disable_by_batch_size`` requests running does not speculate (a
batch that large is compute-bound and verifying rejected drafts would cost
more than it saves); a request whose drafts keep being rejected is left alone for a
while (its gate backs off, doubling); k follows each request's accepted runs. Requests
that do not speculate in a step are counted by reason (``SpecStats.skipped``), never
refused: they decode one token, as without speculation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.errors import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import Proposer
from engine.spec.verify import Verified, grammar_drafts, sample_rows

_EMA = 0.3  # weight of the newest step in a request's acceptance average
_GATE = 0.45  # below this average acceptance, a request stops speculating for a while
_MAX_BACKOFF = 64  # steps


@dataclass
class SpecStats:
    """Counters since the worker started (vLLM's names, in engine terms)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: draft j+1 accepted
    skipped: Counter[str] = field(default_factory=Counter)  # request-steps, by reason


@dataclass
class _Req:
    k: int
    ema: float = 1.0
    wait: int = 0  # steps left before it may speculate again
    backoff: int = 4
    drafted: int = 0  # per-request totals (reported to the client on opt-in)
    accepted: int = 0


class Speculator:
    def __init__(
        self, runner: ModelRunner, config: SpeculativeConfig, proposer: Proposer | None = None
    ) -> None:
        self.runner = runner
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(runner, config)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._reqs: dict[int, _Req] = {}

    def drafts(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """This step's drafts per sequence (some may be empty), or None: no speculation."""
        if len(seqs) > self.config.disable_by_batch_size:
            self.stats.skipped["batch_size"] += len(seqs)
            return None
        ks = [self._k(seq) for seq in seqs]
        asked = [i for i, k in enumerate(ks) if k > 0]
        out: list[list[int]] = [[] for _ in seqs]
        if asked:
            proposed = self.proposer.propose([seqs[i] for i in asked], [ks[i] for i in asked])
            for i, d in zip(asked, proposed, strict=True):
                out[i] = list(d[: ks[i]])
                if not out[i]:
                    self.stats.skipped["no_draft"] += 1
        grammar_drafts(self.runner.grammars, seqs, out)
        for seq, d in zip(seqs, out, strict=True):
            if d and not self._reserve(seq, len(d)):
                d.clear()
        return out if any(out) else None

    def _k(self, seq: Sequence) -> int:
        """How many drafts ``seq`` may verify this step (0: it does not speculate)."""
        r = self._reqs.get(seq.rid)
        if r is None:
            r = self._reqs[seq.rid] = _Req(k=self.config.num_speculative_tokens)
        if r.wait > 0:
            r.wait -= 1
            self.stats.skipped["low_acceptance"] += 1
            return 0
        # Room: positions up to max_model_len, and no draft past max_tokens (the token
        # sampled after the last draft is the last one a step can emit).
        room = min(
            self.runner.max_model_len - seq.num_tokens,
            seq.sampling.max_tokens - len(seq.output_ids) - 1,
        )
        if room <= 0:
            self.stats.skipped["length"] += 1
            return 0
        return min(r.k, room)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        try:
            self.runner.kv.ensure_blocks(seq, n + 1)
        except NoFreeBlocks:
            self.stats.skipped["no_kv_blocks"] += 1
            return False
        return True

    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> Verified:
        logits = self.runner.verify(seqs, drafts)
        return sample_rows(logits, seqs, drafts, self.runner.grammars, self.runner.generator)

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
        r.ema = (1 - _EMA) * r.ema + _EMA * accepted / drafted
        kmax = self.config.num_speculative_tokens
        r.k = min(kmax, 2 * r.k) if accepted == drafted else max(1, accepted + 1)
        if r.ema < _GATE:
            r.wait, r.backoff = r.backoff, min(_MAX_BACKOFF, 2 * r.backoff)
            r.ema = 1.0 - _GATE  # on probation when it comes back
        elif accepted:
            r.backoff = 4

    def counts(self, rid: int) -> tuple[int, int]:
        """(drafted, accepted) tokens of ``rid`` so far on this worker."""
        r = self._reqs.get(rid)
        return (r.drafted, r.accepted) if r is not None else (0, 0)

    def release(self, rid: int) -> None:
        self._reqs.pop(rid, None)
        self.proposer.release(rid)


def make_proposer(runner: ModelRunner, config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from engine.spec.draft_model import DraftModelProposer

    assert config.model is not None
    return DraftModelProposer(runner, config.model)
