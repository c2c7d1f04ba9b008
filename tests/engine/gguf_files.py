"""Write GGUF files from Hugging Face checkpoints the way llama.cpp's converter does.

What ``convert_hf_to_gguf.py`` does for the architectures pdserve runs, reduced to what the
tiny test checkpoints use: llama.cpp tensor names; Q/K rows permuted for ``llama``
(adjacent-pair rotary); Llama 3 rope scaling baked into a ``rope_freqs`` tensor; matrices
stored as F32, F16 or a quantized type, 1-D tensors as F32; the byte-level BPE vocabulary
padded with ``[PAD<i>]`` up to the embedding size, merges, special ids, chat template.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

Q = gguf.GGMLQuantizationType

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{_LAYER[rest]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: rotate-half rows -> adjacent-pair rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs``: the divisor of each rotary frequency (Llama 3 scaling)."""
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(checkpoint: Path, out: Path, qtype: Any = Q.F32, vocab: bool = True) -> Path:
    """A GGUF of ``checkpoint`` (llama, qwen2 or qwen3) with matrices stored as ``qtype``.

    ``vocab=False`` writes a 256-token byte vocabulary instead of the checkpoint's 152k one
    (and no special ids): a file for weight checks, several times faster to write and read.
    """
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    _hparams(w, cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for name, t in load_file(str(checkpoint / "model.safetensors")).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        a = t.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"]
            a = permute(a, heads if "q_proj" in name else cfg["num_key_value_heads"])
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), a)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    if vocab:
        _tokenizer(w, checkpoint, cfg["vocab_size"])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(list(bytes_to_unicode().values()))
        w.add_token_scores([0.0] * 256)  # no merges: transformers derives (none) from scores
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])


def _tokenizer(w: gguf.GGUFWriter, checkpoint: Path, vocab_size: int) -> None:
    """llama.cpp's ``get_vocab_base`` for a byte-level BPE tokenizer.json."""
    tj = json.loads((checkpoint / "tokenizer.json").read_text())
    by_id = {i: tok for tok, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(
                gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED
            )
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tcfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    template_file = checkpoint / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tcfg["chat_template"]
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(gen["bos_token_id"])
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_pad_token_id(gen["bos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(template)
