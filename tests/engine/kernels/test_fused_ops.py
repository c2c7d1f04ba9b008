"""Fused norm / activation / rotary+store kernels equal the torch layers they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cuda.kernels.fused_ops import rmsnorm, silu_mul
from engine.cuda.kernels.rope_store import rope_and_store
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary
from tests.engine.kernels.conftest import DEVICE

# float16, not bfloat16: the interpreter rounds to bfloat16 by truncation, torch to nearest.
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_updates_the_residual_and_normalises_the_sum(dtype: torch.dtype) -> None:
    norm = RMSNorm(48, 1e-6, dtype, DEVICE)  # 48: not a power of two
    norm.weight.data = _randn(48, seed=0, dtype=dtype)
    x, residual = _randn(5, 48, seed=1, dtype=dtype), _randn(5, 48, seed=2, dtype=dtype)
    want_sum = x + residual
    torch.testing.assert_close(rmsnorm(x, norm.weight, norm.eps), norm(x), atol=TOL[dtype], rtol=0)
    out = rmsnorm(x, norm.weight, norm.eps, residual=residual)
    torch.testing.assert_close(residual, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(want_sum), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_the_fused_gate_up_output(dtype: torch.dtype) -> None:
    gate_up = _randn(3, 2 * 40, seed=3, dtype=dtype)
    want = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(silu_mul(gate_up), want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_in_place_and_stores_rotated_k_and_v_in_their_slots(
    dtype: torch.dtype,
) -> None:
    t, heads, kv_heads, d, block_size, layers = 6, 4, 2, 16, 4, 2
    rotary = RotaryEmbedding(d, 64, 10000.0, None, DEVICE, dtype)
    # q, k, v as the model has them: strided column views of one qkv projection.
    qkv = _randn(t, (heads + 2 * kv_heads) * d, seed=4, dtype=dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    positions = torch.tensor([0, 5, 9, 33, 2, 63], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 5, 9, -1, 30, 17], dtype=torch.int32, device=DEVICE)  # -1: pad
    cos_sin = rotary.lookup(positions.long())
    want_q, want_k, want_v = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin), v.clone()
    pool = torch.zeros(8, layers, 2, block_size, kv_heads, d, dtype=dtype, device=DEVICE)

    rope_and_store(q, k, v, rotary.cos, rotary.sin, positions, slots, pool, layer=1)

    torch.testing.assert_close(q, want_q, atol=TOL[dtype], rtol=0)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            torch.testing.assert_close(
                pool[block, 1, 0, offset], want_k[i], atol=TOL[dtype], rtol=0
            )
            torch.testing.assert_close(pool[block, 1, 1, offset], want_v[i], atol=0, rtol=0)
    written = torch.zeros(8 * block_size, dtype=torch.bool)
    written[[s for s in slots.tolist() if s >= 0]] = True
    untouched = pool[:, 1].transpose(0, 1).reshape(2, 8 * block_size, -1)[:, ~written.to(DEVICE)]
    assert not untouched.any() and not pool[:, 0].any()  # nothing else written, no other layer
