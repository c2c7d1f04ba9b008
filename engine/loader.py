"""Load safetensors checkpoints (single file or sharded) into ``CausalLM``.

Checkpoint names map onto the model's fused parameters: q/k/v projections land in row
ranges of ``qkv``, gate/up in row ranges of ``gate_up``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import UnsupportedModelError
from engine.model import CausalLM

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = ("rotary_emb.inv_freq",)


def checkpoint_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    raise UnsupportedModelError(f"{root}: no model.safetensors or safetensors index found")


def iter_tensors(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(root):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _target(model: CausalLM, name: str) -> tuple[torch.Tensor, int, int] | None:
    """The parameter and row range a checkpoint tensor fills; None if it has no home."""
    if name == "model.embed_tokens.weight":
        return model.embed, 0, model.embed.shape[0]
    if name == "lm_head.weight":
        return None if model.config.tie_word_embeddings else (model.lm_head, 0, -1)
    if name == "model.norm.weight":
        return model.norm.weight, 0, -1
    match = _LAYER.match(name)
    if match is None:
        return None
    layer = model.layer(int(match.group(1)))
    attn, rest = layer.attn, match.group(2)
    q, kv = attn.q_size, attn.kv_size
    inter = layer.mlp.inter
    table: dict[str, tuple[torch.Tensor | None, int, int]] = {
        "self_attn.q_proj.weight": (attn.qkv, 0, q),
        "self_attn.k_proj.weight": (attn.qkv, q, q + kv),
        "self_attn.v_proj.weight": (attn.qkv, q + kv, q + 2 * kv),
        "self_attn.q_proj.bias": (attn.qkv_bias, 0, q),
        "self_attn.k_proj.bias": (attn.qkv_bias, q, q + kv),
        "self_attn.v_proj.bias": (attn.qkv_bias, q + kv, q + 2 * kv),
        "self_attn.o_proj.weight": (attn.o, 0, -1),
        "self_attn.q_norm.weight": (attn.q_norm.weight if attn.q_norm else None, 0, -1),
        "self_attn.k_norm.weight": (attn.k_norm.weight if attn.k_norm else None, 0, -1),
        "mlp.gate_proj.weight": (layer.mlp.gate_up, 0, inter),
        "mlp.up_proj.weight": (layer.mlp.gate_up, inter, 2 * inter),
        "mlp.down_proj.weight": (layer.mlp.down, 0, -1),
        "input_layernorm.weight": (layer.input_norm.weight, 0, -1),
        "post_attention_layernorm.weight": (layer.post_attn_norm.weight, 0, -1),
    }
    param, lo, hi = table.get(rest, (None, 0, 0))
    return None if param is None else (param, lo, hi)


@torch.no_grad()
def load_weights(model: CausalLM, root: Path) -> None:
    """Fill every parameter of ``model``; unknown or missing tensors are errors."""
    filled: dict[int, int] = {}  # id(param) -> rows filled
    for name, tensor in iter_tensors(root):
        if name.endswith(_IGNORED):
            continue
        target = _target(model, name)
        if target is None:
            if name == "lm_head.weight":
                continue  # tied checkpoints may still store a copy
            raise UnsupportedModelError(f"{root}: unexpected tensor {name!r} in checkpoint")
        param, lo, hi = target
        hi = param.shape[0] if hi == -1 else hi
        if tuple(tensor.shape) != (hi - lo, *param.shape[1:]):
            raise UnsupportedModelError(
                f"{name}: shape {tuple(tensor.shape)} does not fit {(hi - lo, *param.shape[1:])}"
            )
        param[lo:hi].copy_(tensor)
        filled[id(param)] = filled.get(id(param), 0) + (hi - lo)
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) != p.shape[0]]
    if missing:
        raise UnsupportedModelError(f"{root}: checkpoint lacks weights for {missing}")
    logger.info("loaded %d parameter tensors from %s", len(filled), root)
