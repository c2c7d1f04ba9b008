"""Checkpoints are read as Hugging Face writes them, and rejected clearly when unsupported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bundled_models import tiny
from engine.build import build_engine
from engine.config import EngineConfig, ModelConfig
from engine.errors import UnsupportedModelError
from engine.kv.sequence import Sequence
from engine.model.rope import inv_frequencies
from engine.runner import ModelRunner
from wire.params import SamplingParams


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture_error_names_the_supported_ones(
    default_model_path: Path, tmp_path: Path
) -> None:
    path = _copy_with_config(default_model_path, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3"):
        ModelConfig.from_pretrained(path)


def test_unsupported_rope_type_is_rejected(default_model_path: Path, tmp_path: Path) -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    path = _copy_with_config(default_model_path, tmp_path / "m", rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_pretrained(path)


def test_fields_of_each_tiny_architecture(tiny_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(tiny_model_path)
    assert m.eos_token_ids == (151645, 151643)
    assert (m.num_heads, m.num_kv_heads, m.num_layers) == (4, 2, 2)
    assert m.dtype == torch.float32
    expected = {
        "LlamaForCausalLM": (False, False, False, 16),
        "Qwen2ForCausalLM": (True, False, True, 16),
        "Qwen3ForCausalLM": (False, True, True, 32),
    }[m.architecture]
    assert (m.qkv_bias, m.qk_norm, m.tie_word_embeddings, m.head_dim) == expected


def test_old_style_rope_fields_and_config_eos_fallback(
    default_model_path: Path, tmp_path: Path
) -> None:
    path = _copy_with_config(
        default_model_path,
        tmp_path / "m",
        rope_parameters=None,
        rope_theta=5e5,
        rope_scaling={"type": "linear", "factor": 2.0},
        eos_token_id=7,
    )
    (path / "generation_config.json").unlink()
    m = ModelConfig.from_pretrained(path)
    assert m.rope_theta == 5e5
    assert m.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert m.eos_token_ids == (7,)


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = tiny.tiny_model_dir("llama")
    m = ModelConfig.from_pretrained(path)
    assert m.rope_scaling is not None and m.rope_scaling["rope_type"] == "llama3"
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(path))
    ours = inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling)
    torch.testing.assert_close(ours, ref.float(), atol=1e-7, rtol=1e-6)


def _prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    seq = Sequence(0, prompt, sampling=SamplingParams(), block_size=runner.block_size)
    return runner.prefill([(seq, len(prompt))])[0]


def test_sharded_checkpoint_loads_the_same_weights(
    default_model_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="8MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompt = list(range(100, 140))
    single = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=8)).runner
    sharded = build_engine(EngineConfig(model=str(tmp_path / "sharded"), num_kv_blocks=8)).runner
    torch.testing.assert_close(
        _prefill_logits(sharded, prompt), _prefill_logits(single, prompt), atol=0, rtol=0
    )


def test_bfloat16_runs_close_to_float32(default_model_path: Path) -> None:
    prompt = list(range(1000, 1030))
    f32 = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=4)).runner
    bf16 = build_engine(
        EngineConfig(model=str(default_model_path), dtype="bfloat16", num_kv_blocks=4)
    ).runner
    assert bf16.kv.tensor.dtype == torch.bfloat16
    a, b = _prefill_logits(f32, prompt), _prefill_logits(bf16, prompt)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()
