"""The CUDA decode attention's grouped-heads form equals grouped-query SDPA (checked on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import _causal_sdpa, grouped_causal_sdpa, grouped_decode_sdpa


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (14, 2)])
def test_grouped_decode_equals_enable_gqa(heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, s, d = 3, 37, 16
    q = torch.randn(b, heads, d, generator=g)
    # Strided like the engine's views of gathered blocks: (B, S, KVH, D) transposed.
    keys = torch.randn(b, s, kv_heads, d, generator=g).transpose(1, 2)
    values = torch.randn(b, s, kv_heads, d, generator=g).transpose(1, 2)
    lengths = torch.tensor([37, 5, 20])
    beyond = torch.arange(s)[None, :] >= lengths[:, None]  # (B, S): past each sequence's end
    bias = torch.zeros(b, s).masked_fill(beyond, float("-inf")).view(b, 1, 1, s)
    want = F.scaled_dot_product_attention(
        q.view(b, heads, 1, d), keys, values, attn_mask=bias, enable_gqa=True
    ).view(b, heads, d)
    torch.testing.assert_close(grouped_decode_sdpa(q, keys, values, bias), want)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n", "c"), [(8, 2, 5, 37), (4, 4, 16, 16), (14, 2, 1, 9)]
)
def test_grouped_causal_equals_enable_gqa(heads: int, kv_heads: int, n: int, c: int) -> None:
    """The CUDA continuation-chunk form: n queries at the end of a context of c keys."""
    g = torch.Generator().manual_seed(heads + n + c)
    q = torch.randn(n, heads, 16, generator=g)
    k, v = (torch.randn(c, kv_heads, 16, generator=g) for _ in range(2))
    torch.testing.assert_close(grouped_causal_sdpa(q, k, v), _causal_sdpa(q, k, v))
