"""benchmarks.peers --shape: a larger model's shapes, random weights, in a checkpoint dir
that transformers and pdserve both read as that shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peers import shapes
from engine.config import ModelConfig


def test_a_shape_is_the_base_config_with_its_fields_and_seeded_weights(
    default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = json.loads((default_model_path / "config.json").read_text())
    shape = {
        "hidden_size": 2 * base["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    monkeypatch.setitem(shapes.SHAPES, "wide", shape)
    made = shapes.ensure_shape(tmp_path / "a", "wide", default_model_path)
    config = ModelConfig.from_pretrained(made)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
        shape["hidden_size"],
        3,
        4,
        2,
    )
    assert config.vocab_size == base["vocab_size"]  # the base's tokenizer serves it
    assert (made / "tokenizer.json").exists() or (made / "vocab.json").exists()
    from safetensors.torch import load_file

    weights = load_file(made / "model.safetensors")
    mlp = weights["model.layers.2.mlp.down_proj.weight"]
    assert tuple(mlp.shape) == (shape["hidden_size"], 96) and mlp.float().std() > 0
    again = load_file(
        shapes.ensure_shape(tmp_path / "b", "wide", default_model_path) / "model.safetensors"
    )
    assert all(bool((weights[k] == again[k]).all()) for k in weights)  # seeded: the same file
    before = (made / "model.safetensors").stat().st_mtime_ns
    shapes.ensure_shape(tmp_path / "a", "wide", default_model_path)
    assert (made / "model.safetensors").stat().st_mtime_ns == before  # made once


def test_an_unknown_shape_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="smollm2-360m"):
        shapes.ensure_shape(tmp_path, "gpt-5", tmp_path)
