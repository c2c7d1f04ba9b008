"""Exact verification of drafts: sample the target at every drafted position.

A request with newest token t and drafts d_1..d_k is run as k + 1 query rows (``verify``
in engine/runner.py); row j is sampled by the ordinary sampler exactly as decode would
sample output position ``len(output) + j`` had d_1..d_j been sampled before it: the
penalties see them in the history, the grammar mask is the matcher's after them, and a
seeded request's uniform draw is keyed by that output position. Accepting while the sample
equals the draft, plus the first sample that does not (or the bonus sample after the
last draft), therefore emits exactly the tokens decoding one at a time would, for greedy
and seeded sampling alike; unseeded sampling draws each emitted token from the target's
distribution given the tokens before it, as decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.sequence import Sequence
from engine.sampling.grammar import GrammarCache
from engine.sampling.grammar_mask import apply_bitmask, new_bitmask
from engine.sampling.sampler import Constraint, SampleOutput, SampleRequest, sample


@dataclass(frozen=True)
class Verified:
    """Per request: the sampled token of each of its rows, and its first row's index."""

    sample: SampleOutput  # over all rows of the batch
    tokens: list[list[int]]  # [request][j]: sample of row j (len(drafts) + 1 each)
    first_row: list[int]


def accepted_run(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts agree with the target's samples (``sampled`` has one more)."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m


def grammar_drafts(cache: GrammarCache, seqs: list[Sequence], drafts: list[list[int]]) -> None:
    """Cut each constrained sequence's drafts before the first one its grammar forbids.

    A sample at that row can never equal it, so the rows after it could not be emitted;
    cutting keeps every row's mask well defined. The matchers are left as they were.
    """
    for seq, d in zip(seqs, drafts, strict=True):
        if seq.sampling.grammar is None or not d:
            continue
        if seq.grammar is None:
            seq.grammar = cache.state(seq.sampling.grammar, seq.output_ids, seq.rid)
        del d[seq.grammar.valid_prefix(d) :]


def sample_rows(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    cache: GrammarCache,
    generator: torch.Generator,
) -> Verified:
    """Sample every row of a ``verify`` forward's logits (R, V), R = sum(len(d) + 1)."""
    rows: list[SampleRequest] = []
    first_row: list[int] = []
    for seq, d in zip(seqs, drafts, strict=True):
        first_row.append(len(rows))
        rows += [
            SampleRequest(seq.sampling, seq.prompt_ids, seq.output_ids + d[:j])
            for j in range(len(d) + 1)
        ]
    out = sample(logits, rows, generator, _constraint(cache, seqs, drafts, first_row))
    if out.token_ids.is_cuda:
        out = SampleOutput(
            out.token_ids.cpu(), out.logprobs.cpu(), out.top_ids.cpu(), out.top_logprobs.cpu()
        )
    flat = out.token_ids.tolist()
    tokens = [flat[f : f + len(d) + 1] for f, d in zip(first_row, drafts, strict=True)]
    return Verified(out, tokens, first_row)


def _constraint(
    cache: GrammarCache, seqs: list[Sequence], drafts: list[list[int]], first_row: list[int]
) -> Constraint | None:
    """The grammar mask of every constrained row: row j of a sequence is masked as its
    matcher stands after drafts 1..j (``grammar_drafts`` made them all valid)."""
    constrained = [i for i, s in enumerate(seqs) if s.sampling.grammar is not None]
    if not constrained:
        return None
    total = first_row[-1] + len(drafts[-1]) + 1
    bitmask = new_bitmask(total, cache.vocab_size)
    rows: list[int] = []
    for i in constrained:
        seq = seqs[i]
        if seq.grammar is None:
            assert seq.sampling.grammar is not None
            seq.grammar = cache.state(seq.sampling.grammar, seq.output_ids, seq.rid)
        seq.grammar.fill_along(drafts[i], bitmask, first_row[i])
        rows += range(first_row[i], first_row[i] + len(drafts[i]) + 1)
    return lambda logits: apply_bitmask(logits, bitmask, rows)
