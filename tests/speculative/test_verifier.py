"""The verifier's rule on synthetic logits: emitted tokens follow the target exactly."""

from __future__ import annotations

from collections import Counter

import torch

from engine.kv.sequence import Sequence
from engine.sampling.grammar import GrammarCache
from engine.speculative.verify import accepted_run, sample_rows
from wire.params import SamplingParams

V = 6
# The target's distribution at the first drafted position, and after the draft.
P0 = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
P1 = torch.tensor([0.30, 0.05, 0.05, 0.20, 0.20, 0.20])
DRAFT = 3  # the proposer's guess for the first position (the target's second choice)
# chi-square 0.999 quantile for 10 degrees of freedom (11 outcomes - 1).
CHI2_999_DF10 = 29.59


def _emitted(n: int, seeded: bool) -> Counter[tuple[int, ...]]:
    """Verify one draft on ``n`` requests whose logits are log P0, log P1."""
    seqs, drafts = [], []
    for i in range(n):
        params = SamplingParams(temperature=1.0, seed=i if seeded else None, max_tokens=8)
        seqs.append(Sequence(rid=i, prompt_ids=[1, 2], output_ids=[4], sampling=params))
        drafts.append([DRAFT])
    logits = torch.stack([P0.log(), P1.log()]).repeat(n, 1)  # (2n, V)
    gen = torch.Generator().manual_seed(1234)
    v = sample_rows(logits, seqs, drafts, GrammarCache(lambda: None, V), gen)
    out: Counter[tuple[int, ...]] = Counter()
    for d, tokens in zip(drafts, v.tokens, strict=True):
        m = accepted_run(d, tokens)
        out[tuple(tokens[: m + 1])] += 1
    return out


def _expected() -> dict[tuple[int, ...], float]:
    """Decoding one token at a time: x ~ P0, then (only if x was the draft) y ~ P1."""
    exp = {(x,): float(P0[x]) for x in range(V) if x != DRAFT}
    exp.update({(DRAFT, y): float(P0[DRAFT] * P1[y]) for y in range(V)})
    return exp


def _chi2(counts: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(expected), set(counts) - set(expected)
    return sum((counts[k] - n * p) ** 2 / (n * p) for k, p in expected.items())


def test_accepted_tokens_follow_the_target_distribution() -> None:
    for seeded in (False, True):
        counts = _emitted(20_000, seeded)
        assert _chi2(counts, _expected()) < CHI2_999_DF10
        # The test has power: emitting the draft whenever the target could have picked it
        # (a lenient rule) would be far off.
        lenient = dict(_expected())
        lenient[(DRAFT, 0)] += 0.1
        lenient[(1,)] -= 0.1
        assert _chi2(counts, lenient) > 10 * CHI2_999_DF10


def test_accepted_run_is_the_agreeing_prefix() -> None:
    assert accepted_run([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_run([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_run([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_run([], [4]) == 0
