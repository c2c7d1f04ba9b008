"""The KV layout is stated once (wire/kv_layout.py): the engine's pools and the
transport's views of them agree with it byte for byte."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.kv.kv_cache import allocate_kv_pool, layout_of, pool_layout
from wire.kv_layout import KVLayout


def _model() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=48,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        max_position_embeddings=256,
        eos_token_ids=(0,),
        dtype_name="float32",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_engine_pool_has_the_layout_its_model_states(dtype: torch.dtype) -> None:
    m = _model()
    pool = allocate_kv_pool(m, 5, 16, dtype)
    layout = pool_layout(m, 5, 16, dtype)
    assert layout_of(pool) == layout
    assert tuple(pool.shape) == layout.shape
    assert pool.dtype == layout.torch_dtype
    assert pool[0].numel() * pool.element_size() == layout.block_nbytes
    assert pool.numel() * pool.element_size() == layout.nbytes
    # The launcher plans by dtype name (it does not import torch): the same layout.
    assert pool_layout(m, 5, 16, str(dtype).removeprefix("torch.")) == layout


def test_the_layout_round_trips_as_json_and_refuses_unknown_dtypes() -> None:
    layout = KVLayout(7, 2, 16, 2, 64, "bfloat16")
    assert KVLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ValueError, match="int8"):
        KVLayout(1, 1, 16, 1, 8, "int8")


def test_the_transport_speaks_the_same_class() -> None:
    import transport.kv

    assert transport.kv.KVLayout is KVLayout  # imported, not restated


def test_the_block_order_round_trips_and_must_be_known() -> None:
    layout = KVLayout(7, 2, 16, 2, 64, "float32", order="vec16")
    assert KVLayout.from_json(layout.to_json()).order == "vec16"
    assert KVLayout(7, 2, 16, 2, 64).order == "tokens"
    with pytest.raises(ValueError, match="block order"):
        KVLayout(7, 2, 16, 2, 64, order="amx")
