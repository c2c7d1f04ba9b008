"""Prompt lookup / n-gram proposals, indexed incrementally.

For each request: a dict per n-gram size n in [lo, hi] from the n tokens ending at some
position to the position right after them (the most recent occurrence wins). Each
appended token adds one entry per size, and a proposal is one lookup per size (longest
first) of the request's current suffix: no scan of the context per step. The drafts are
the tokens that followed that earlier occurrence, as far as they go (at most k).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.sequence import Sequence
from engine.speculative.proposer import Proposer


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)  # the request's tokens indexed so far
    # by_size[n - lo]: n-gram (tuple) -> position of the token that followed it
    by_size: list[dict[tuple[int, ...], int]] = field(default_factory=list)


class NgramProposer(Proposer):
    cheap = True  # a dict lookup per n-gram size

    def __init__(self, lo: int, hi: int) -> None:
        assert 1 <= lo <= hi, (lo, hi)
        self.lo, self.hi = lo, hi
        self._index: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self._one(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def release(self, rid: int) -> None:
        self._index.pop(rid, None)

    def _one(self, seq: Sequence, k: int) -> list[int]:
        idx = self._catch_up(seq)
        toks, end = idx.tokens, len(idx.tokens)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            follow = idx.by_size[n - self.lo].get(tuple(toks[end - n :]))
            if follow is not None:
                return toks[follow : follow + k]
        return []

    def _catch_up(self, seq: Sequence) -> _Index:
        """Index the tokens appended to ``seq`` since the last call."""
        idx = self._index.get(seq.rid)
        if idx is None:
            idx = self._index[seq.rid] = _Index(by_size=[{} for _ in range(self.lo, self.hi + 1)])
        toks = idx.tokens
        have, p = len(toks), len(seq.prompt_ids)
        if have < seq.num_tokens:
            toks += seq.prompt_ids[have:] if have < p else []
            toks += seq.output_ids[max(0, have - p) :]
        lo, hi = self.lo, self.hi
        for pos in range(max(have, 1), len(toks)):
            # The n-grams ending at pos - 1 are followed by the token at pos.
            for n in range(lo, min(hi, pos) + 1):
                idx.by_size[n - lo][tuple(toks[pos - n : pos])] = pos
        return idx
