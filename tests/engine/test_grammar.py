"""Token masks: the bitmask applied to logits keeps exactly the allowed tokens, whatever
the mix of sparse rows (few tokens allowed) and dense ones (most allowed)."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.grammar_mask import apply_bitmask, new_bitmask


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(B, W * 32) bool -> (B, W) int32 bitmask, bit j of word w = token 32 w + j."""
    b, n = allowed.shape
    bits = allowed.view(b, n // 32, 32).to(torch.int64) << torch.arange(32)
    packed = bits.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("densities", [(1e-4,), (0.3,), (0.999,), (1e-4, 0.999, 0.02, 0.5)])
def test_masked_logits_keep_exactly_the_allowed_tokens(densities: tuple[float, ...]) -> None:
    vocab = 1000  # not a multiple of 32: the last word's tail is past the vocabulary
    g = torch.Generator().manual_seed(0)
    width = -(-vocab // 32) * 32
    allowed = torch.stack(
        [torch.rand(width, generator=g) < densities[i % len(densities)] for i in range(8)]
    )
    allowed[:, 0] = True  # every row allows something
    logits = torch.randn(8, vocab, generator=g)
    rows = [0, 2, 3, 5, 7]  # the others are unconstrained rows of the batch
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~allowed[rows, :vocab], float("-inf"))
    apply_bitmask(logits, _pack(allowed), rows)
    assert torch.equal(logits, want)


def test_a_new_bitmask_allows_everything() -> None:
    assert bool((new_bitmask(2, 100) == -1).all()) and new_bitmask(2, 100).shape == (2, 4)
