"""A GGUF file's metadata as Hugging Face ``config.json`` and ``generation_config.json``.

llama.cpp stores hyper-parameters under ``<arch>.<name>`` keys (``llama.block_count``,
``qwen2.attention.head_count_kv``, ...). This module maps the three architectures the
engine runs (see ``engine/config.py``) back to the transformers spelling, so that a
converted directory loads in the engine *and* in transformers (the parity reference).

Llama 3.x rope scaling is the one option llama.cpp does not keep as metadata: its converter
bakes it into a ``rope_freqs`` tensor of per-frequency divisors. ``llama3_rope_from_factors``
recovers the HF parameters from that tensor and checks them by recomputing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.errors import UnsupportedModelError
from engine.model.rope import inv_frequencies

# GGUF general.architecture -> (HF architecture, HF model_type). Mistral GGUFs are written
# as "llama" by llama.cpp (same tensors, same math), so they land on LlamaForCausalLM.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

Meta = Callable[[str, Any], Any]  # (key without the "<arch>." prefix, default) -> value


def hf_config(
    arch: str,
    meta: Meta,
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: torch.Tensor | None,
    dtype: str,
) -> dict[str, Any]:
    """config.json for a GGUF of ``arch``; ``tensor_shapes`` are torch-order, by GGUF name."""
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    hidden = int(meta("embedding_length", None))
    heads = int(meta("attention.head_count", None))
    kv_heads = _uniform(meta("attention.head_count_kv", heads), "attention.head_count_kv")
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"GGUF rotates {rope_dim} of {head_dim} head dimensions; only full rotary is supported"
        )
    theta = _f32(meta("rope.freq_base", 10000.0))
    max_len = int(meta("context_length", 2048))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": _uniform(meta("feed_forward_length", None), "feed_forward_length"),
        "num_hidden_layers": int(meta("block_count", None)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": max_len,
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, rope_freqs, head_dim, theta, max_len),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "dtype": dtype,
    }
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def generation_config(token_ids: dict[str, int | None]) -> dict[str, Any]:
    """generation_config.json: BOS, and every end token the file names (EOS, EOT, EOM)."""
    eos = [t for k in ("eos", "eot", "eom") if (t := token_ids.get(k)) is not None]
    out: dict[str, Any] = {"do_sample": False}
    if token_ids.get("bos") is not None:
        out["bos_token_id"] = token_ids["bos"]
    if eos:
        unique = list(dict.fromkeys(eos))
        out["eos_token_id"] = unique[0] if len(unique) == 1 else unique
    return out


def _f32(value: Any) -> float:
    # GGUF floats are float32: 1e-5 reads back as 9.999999747378752e-06. The shortest
    # decimal that rounds to the same float32 keeps config.json readable and exact.
    return float(str(np.float32(value)))


def _uniform(value: Any, key: str) -> int:
    # Some architectures vary these per layer (arrays); the engine's layers are uniform.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"GGUF {key} varies by layer ({value}); not supported")
        value = value[0]
    return int(value)


def _rope_scaling(
    meta: Meta, rope_freqs: torch.Tensor | None, head_dim: int, theta: float, max_len: int
) -> dict[str, Any] | None:
    kind = str(meta("rope.scaling.type", "none"))
    if rope_freqs is not None:
        if kind not in ("none", "llama3"):
            raise UnsupportedModelError(f"GGUF has rope_freqs and rope scaling {kind!r}")
        # Llama 3's own 8192 where the context is longer (transformers wants it shorter).
        return llama3_rope_from_factors(rope_freqs, head_dim, theta, min(8192, max_len // 2))
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(meta("rope.scaling.factor", 1.0))}
    raise UnsupportedModelError(
        f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3"
    )


def llama3_rope_from_factors(
    factors: torch.Tensor, head_dim: int, theta: float, original_len: int = 8192
) -> dict[str, Any] | None:
    """HF ``llama3`` rope parameters equal to llama.cpp's ``rope_freqs`` divisors.

    llama.cpp divides frequency i by ``factors[i]`` = 1 / ((1 - s) / factor + s), where the
    smoothing s = (original_len / wavelen - low) / (high - low), clipped to [0, 1], is linear
    in 1 / wavelen. Any (original_len, low, high) giving the same line gives the same rope,
    so ``original_len`` is chosen by the caller and (low, high) come from two points of
    the line. The answer is checked by recomputing the frequencies the engine would use.
    """
    r = factors.double().flatten()  # (head_dim // 2,)
    base = inv_frequencies(head_dim, theta, None).double()
    factor = float(r.max())
    if factor <= 1.0 + 1e-6:
        return None  # every divisor is 1: plain rope
    s = (1.0 / r - 1.0 / factor) / (1.0 - 1.0 / factor)  # smoothing per frequency
    u = base / (2 * math.pi)  # 1 / wavelen, decreasing with i
    tol = 1e-6
    points = [(float(u[i]), float(s[i])) for i in range(len(r)) if tol < s[i] < 1 - tol]
    slow = [i for i in range(len(r)) if s[i] <= tol]  # low frequencies, divided by factor
    kept = [i for i in range(len(r)) if s[i] >= 1 - tol]  # high frequencies, unchanged
    if len(points) < 2 and slow:
        points.append((float(u[min(slow)]), 0.0))  # the fastest slowed frequency: s = 0
    if len(points) < 2 and kept:
        points.append((float(u[max(kept)]), 1.0))  # the slowest kept frequency: s = 1
    if len(points) < 2:
        # Every frequency slowed: linear scaling by `factor` is the same rope.
        return {"rope_type": "linear", "factor": factor}
    (u0, s0), (u1, s1) = max(points), min(points)
    a = (s0 - s1) / (u0 - u1)  # s = a * u + b, with a = original_len / (high - low)
    b = s0 - a * u0  # b = -low / (high - low)
    width = original_len / a
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": -b * width,
        "high_freq_factor": (1.0 - b) * width,
        "original_max_position_embeddings": original_len,
    }
    want = (base / r).float()
    got = inv_frequencies(head_dim, theta, params)
    if not torch.allclose(got, want, rtol=1e-5, atol=0):
        raise UnsupportedModelError("GGUF rope_freqs do not match Llama 3 rope scaling")
    return params
