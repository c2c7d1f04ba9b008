"""Larger models' shapes for the head-to-head: random weights in an HF checkpoint dir.

Every figure on the embedded SmolLM2-135M says little about the 0.3B-8B models users
serve on CPUs: at 135M, per-call costs and caches decide much. A checkpoint of a larger
model's exact shapes (layers, widths, heads) with random weights costs every server the
same bytes and arithmetic a token as the real model, which is what throughput and latency
depend on; the tokens it writes are noise, so the sweep forces lengths (``ignore_eos``).

The checkpoint takes the default model's tokenizer and config, with the shape's fields
replaced: every server then reads the same dir, and llama.cpp's converter and quantizer
make the one GGUF that llama.cpp and pdserve both serve (``files.gguf_files``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# name -> the config fields that differ from SmolLM2-135M's (LlamaForCausalLM, vocabulary
# 49152, tied embeddings, head size 64): the published configs' own values.
SHAPES: dict[str, dict[str, int]] = {
    "smollm2-360m": {
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
    },
    # Qwen2.5-0.5B's body (24 layers of width 896, 14 heads over 2 KV heads, MLP 4864) on
    # SmolLM2's vocabulary: its own 151936-token one needs its tokenizer, which no package
    # here ships. Its head is then a third of the real one's bytes.
    "qwen2.5-0.5b-body": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
_SEED = 0


def shape_dir(root: Path, name: str) -> Path:
    return root / "shapes" / f"{name}-random"


def ensure_shape(root: Path, name: str, base: Path) -> Path:
    """The checkpoint dir of shape ``name`` under ``root`` (made from ``base``'s config and
    tokenizer if missing): bfloat16 weights drawn as the model's own initializer draws them
    (seeded, so a remade dir has the same weights)."""
    if name not in SHAPES:
        raise SystemExit(f"--shape {name}: one of {', '.join(SHAPES)}")
    dest = shape_dir(root, name)
    if (dest / "model.safetensors").exists():
        return dest
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((base / "config.json").read_text())
    config.update(SHAPES[name])
    config.pop("layer_types", None)  # one a layer of the base's count: derived again
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config["torch_dtype"] = "bfloat16"
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    torch.manual_seed(_SEED)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(tmp), torch_dtype=torch.bfloat16
    )
    model.save_pretrained(tmp, safe_serialization=True)
    for f in _TOKENIZER_FILES:
        if (base / f).exists():
            shutil.copy2(base / f, tmp / f)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
