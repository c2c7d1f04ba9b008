"""A batch's grammar mask: which tokens each constrained row may sample next.

The torch half of structured output (engine/sampling/grammar.py compiles and tracks grammars and
is imported by the frontend, which has no torch): a (B, ceil(V / 32)) int32 bitmask on
the host, filled by xgrammar's matchers and applied to the (B, V) logits in place.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.sampling.grammar import GrammarCache, GrammarState
from engine.sampling.sampler import Constraint
from wire.params import SamplingParams


class Constrained(Protocol):
    """What ``batch_constraint`` reads and sets on a sequence (engine/kv/sequence.py's)."""

    rid: int
    sampling: SamplingParams
    output_ids: list[int]
    grammar: GrammarState | None


def batch_constraint(cache: GrammarCache, seqs: Sequence[Constrained]) -> Constraint | None:
    """The mask of a batch's constrained rows, or None when no row has a grammar.

    A sequence sampled here for the first time gets its matcher now, replaying what it
    has produced (a handoff from prefill, a resumed request); its grammar is compiled,
    as the schedulers wait for ``ready`` (else this waits for the compile).
    """
    rows = [i for i, s in enumerate(seqs) if s.sampling.grammar is not None]
    if not rows:
        return None
    states = []
    for i in rows:
        seq = seqs[i]
        if seq.grammar is None:
            assert seq.sampling.grammar is not None
            seq.grammar = cache.state(seq.sampling.grammar, seq.output_ids, seq.rid)
        states.append(seq.grammar)
    bitmask = new_bitmask(len(seqs), cache.vocab_size)
    fill_bitmask(states, bitmask, rows)
    if _DEAD_END is not None:
        _force_dead_ends(seqs, rows, bitmask, _DEAD_END)
    return lambda logits: apply_bitmask(logits, bitmask, rows)


# Test-only, unset in production: a request whose grammar text holds this marker and then
# a number N gets a mask that allows no token at its output position N, as a grammar
# with a dead end would (tests/e2e/test_grammar_dead_end.py).
DEAD_END_ENV = "PDSERVE_TEST_GRAMMAR_DEAD_END"
_DEAD_END = os.environ.get(DEAD_END_ENV) or None


def _force_dead_ends(
    seqs: Sequence[Constrained], rows: list[int], bitmask: torch.Tensor, marker: str
) -> None:
    for i in rows:
        spec = seqs[i].sampling.grammar
        assert spec is not None
        found = re.search(re.escape(marker) + r"(\d+)", spec.text)
        if found is not None and int(found.group(1)) == len(seqs[i].output_ids):
            bitmask[i] = 0


def fill_bitmask(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
    """``states[k].fill(bitmask, rows[k])`` for every k, on several threads at once."""
    import xgrammar as xgr

    live = [
        (s, r)
        for s, r in zip(states, rows, strict=True)
        if not s.failed and not s._matcher.is_terminated()
    ]
    if len(live) < 2:
        for s, r in live:
            s.fill(bitmask, r)
        return
    global _batch_matcher
    if _batch_matcher is None:
        # Half the cores at most: the other workers on this host need theirs (on a
        # 2-core host one thread beats two).
        threads = max(1, min(8, (os.cpu_count() or 1) // 2))
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
    _batch_matcher.batch_fill_next_token_bitmask(
        [s._matcher for s, _ in live], bitmask, indices=[r for _, r in live]
    )


_batch_matcher: Any = None


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """(rows, ceil(V / 32)) int32, every bit set (every token allowed)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t] = -inf`` for every ``r`` in ``rows`` and token ``t`` not allowed.

    ``logits`` (B, V) float32 in place; ``bitmask`` (B, ceil(V / 32)) int32 on the host.
    Most grammar states allow a handful of tokens (JSON punctuation, keys, enums, digits):
    those rows are filled with -inf and their few allowed logits put back, which costs a
    row's fill; rows that allow many tokens (inside a string) go through xgrammar's
    kernel, whose cost grows with the tokens it masks.
    """
    import xgrammar as xgr

    with torch.inference_mode():  # ``logits`` is the forward's inference tensor
        _apply(xgr, logits, bitmask, rows)


def _apply(xgr: Any, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    words = bitmask[rows]  # (R, W)
    sparse = (words != 0).sum(dim=1) <= words.shape[1] // _SPARSE_WORDS_FRACTION
    sparse_rows = [r for r, s in zip(rows, sparse.tolist(), strict=True) if s]
    dense_rows = [r for r, s in zip(rows, sparse.tolist(), strict=True) if not s]
    if sparse_rows:
        _apply_sparse(logits, words[sparse], sparse_rows)
    if dense_rows:
        mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, mask, vocab_size=logits.shape[1], indices=dense_rows
        )


_SPARSE_WORDS_FRACTION = 4  # a row is sparse when at most 1/4 of its words allow anything
_BITS = torch.arange(32, dtype=torch.int32)


def _apply_sparse(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> None:
    """``words`` (S, W): the bitmask of ``rows``; keep only their allowed logits."""
    vocab = logits.shape[1]
    row_of, word = words.nonzero(as_tuple=True)  # (N,) words with an allowed token
    bits = (words[row_of, word].unsqueeze(1) >> _BITS) & 1  # (N, 32); sign-safe
    tokens = word.unsqueeze(1) * 32 + _BITS.to(word.dtype)  # (N, 32)
    keep = (bits == 1) & (tokens < vocab)
    row_ids = torch.tensor(rows, dtype=torch.long)
    at_rows = row_ids[row_of.unsqueeze(1).expand(-1, 32)[keep]].to(logits.device)
    at_tokens = tokens[keep].to(logits.device)
    kept = logits[at_rows, at_tokens]
    logits.index_fill_(0, row_ids.to(logits.device), float("-inf"))
    logits[at_rows, at_tokens] = kept
