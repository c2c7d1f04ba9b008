"""Convert a GGUF checkpoint (llama.cpp's single-file format) into a Hugging Face directory.

The engine loads Hugging Face checkpoint directories only; a ``.gguf`` becomes one, once,
offline, and everything downstream (loader, tokenizer, chat template) is unchanged:

    convert_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), out_dir)

* config.json / generation_config.json from the file's metadata (``engine/checkpoint/gguf_config.py``);
* model.safetensors (sharded past ``SHARD_BYTES``): every tensor de-quantized with
  ``gguf.quants.dequantize`` to float32 (F16/BF16 tensors are kept as they are: exact
  either way), renamed to the HF names, and for ``llama`` files with llama.cpp's Q/K row
  permutation undone;
* tokenizer files with the chat template (``engine/tokenizer/gguf_tokenizer.py``).

Architectures and tensor types outside ``GGUF_ARCHITECTURES`` / ``SUPPORTED_TENSOR_TYPES``
raise ``UnsupportedModelError`` naming what is supported, before anything is written.
The serving dtype is chosen at load time as for any checkpoint (``--dtype``).
"""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors.torch import save_file

from engine.checkpoint.gguf_config import GGUF_ARCHITECTURES, generation_config, hf_config
from engine.errors import UnsupportedModelError
from engine.gguf_reader import GGUFHeader
from engine.tokenizer.gguf_tokenizer import check_tokenizer, save_tokenizer
from engine.weights.plan import GGUF_SOURCE_FILE
from engine.weights.quant import PACKABLE_GGUF_TYPES, from_gguf_blocks

logger = logging.getLogger(__name__)

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q8_0,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
    }
)
_KEPT = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # stored as-is, not widened
SHARD_BYTES = 2 << 30

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFCheckpoint:
    """An opened, validated GGUF file: architecture, metadata and tensors by GGUF name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.header = GGUFHeader(path)
        except (ValueError, OSError, struct.error) as e:
            raise UnsupportedModelError(f"{path}: not a readable GGUF file ({e})") from e
        self.arch = str(self.get("general.architecture", ""))
        if self.arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensors = self.header.tensors
        bad = sorted(
            {t.qtype.name for t in self.tensors.values()} - {q.name for q in SUPPORTED_TENSOR_TYPES}
        )
        if bad:
            raise UnsupportedModelError(
                f"{path}: GGUF tensor type(s) {', '.join(bad)} are not supported; supported: "
                f"{', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))}"
            )
        unknown = [n for n in self.tensors if n != "rope_freqs.weight" and _hf_name(n) is None]
        if unknown:
            raise UnsupportedModelError(f"{path}: unexpected GGUF tensors {unknown[:5]}")
        check_tokenizer(self.get("tokenizer.ggml.model"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>``; a missing key without a default is a clear error."""
        value = self.get(f"{self.arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"{self.path}: GGUF lacks {self.arch}.{key}")
        return value

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor in torch order: F16/BF16 as stored, everything else as float32."""
        t = self.tensors[name]
        data = self.header.data(t)
        if t.qtype in _KEPT:
            raw = np.array(data).view(np.uint16)  # a copy; bf16 has no numpy dtype
            return torch.from_numpy(raw.reshape(t.shape)).view(_KEPT[t.qtype])
        out = np.array(dequantize(data, t.qtype), dtype=np.float32)  # a copy off the map
        return torch.from_numpy(out.reshape(t.shape))

    def storage_dtype(self) -> str:
        """The dtype config.json records: the file's half type if it has one, else float32."""
        kinds = {t.qtype for t in self.tensors.values() if len(t.shape) > 1}
        if kinds == {Q.BF16}:
            return "bfloat16"
        return "float16" if kinds == {Q.F16} else "float32"


def hf_tensors(
    ckpt: GGUFCheckpoint, config: dict[str, Any], packed: bool = False
) -> Iterator[tuple[str, Any, str]]:
    """(HF name, value, GGUF type name) for every weight, in file order.

    The value is a float tensor, de-quantized; with ``packed``, a Q4_0/Q4_1/Q8_0 tensor
    comes as its blocks' exact ``QuantRows`` instead (``engine/weights/quant.py``).
    """
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, info in ckpt.tensors.items():
        if name == "rope_freqs.weight":
            continue  # already folded into config.json's rope_scaling
        hf_name = _hf_name(name)
        assert hf_name is not None, name  # GGUFCheckpoint refused unknown names
        value: Any
        if packed and info.qtype in PACKABLE_GGUF_TYPES:
            value = from_gguf_blocks(ckpt.header.data(info), info.qtype, info.shape)
        else:
            value = ckpt.tensor(name)
        if ckpt.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = heads if "attn_q" in name else kv_heads
            rows = unpermute_rows(torch.arange(info.shape[0]), n_head)
            value = value[rows] if isinstance(value, torch.Tensor) else value.rows(rows)
        yield hf_name, value, info.qtype.name


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation for ``llama`` GGUFs.

    HF Llama rotates "halves" (dims i and i + d/2 of a head form a pair); llama.cpp rotates
    adjacent pairs (2i, 2i+1), so its converter reorders each head's rows as
    (n_head, 2, d/2) -> (n_head, d/2, 2). This is the inverse: (n_head, d/2, 2) -> (n_head, 2, d/2).
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.match(name)
    if m is None or m.group(2) not in _PER_LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}"


def convert_gguf(path: Path, out: Path) -> None:
    """Write a Hugging Face checkpoint directory for the GGUF at ``path`` into ``out``."""
    ckpt = GGUFCheckpoint(path)
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    rope_freqs = ckpt.tensor("rope_freqs.weight") if "rope_freqs.weight" in ckpt.tensors else None
    config = hf_config(ckpt.arch, ckpt.arch_get, shapes, rope_freqs, ckpt.storage_dtype())
    ids = {k: ckpt.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom")}
    config.update({f"{k}_token_id": ids[k] for k in ("bos", "eos") if ids[k] is not None})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config(ids), indent=2))
    _save_sharded(((n, t) for n, t, _ in hf_tensors(ckpt, config)), out)
    # Where the blocks came from: a quantized serving path reads them from there.
    (out / GGUF_SOURCE_FILE).write_text(json.dumps({"path": str(path.resolve())}))
    save_tokenizer(path, out, config["model_type"], config["max_position_embeddings"])
    logger.info("converted %s (%s, %d tensors) into %s", path, ckpt.arch, len(shapes), out)


def _save_sharded(tensors: Iterator[tuple[str, torch.Tensor]], out: Path) -> None:
    """model.safetensors, or numbered shards + an index once the weights pass SHARD_BYTES.

    NOTE: only the shard being filled is in RAM; the GGUF itself stays memory-mapped.
    """
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors:
        if shard and size + t.nbytes > SHARD_BYTES:
            _write_shard(
                shard,
                out / f"model-{len(set(weight_map.values())) + 1:05d}.safetensors",
                weight_map,
            )
            shard, size = {}, 0
        shard[name] = t
        size += t.nbytes
    if not weight_map:  # everything fits one file
        save_file(shard, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    _write_shard(
        shard, out / f"model-{len(set(weight_map.values())) + 1:05d}.safetensors", weight_map
    )
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_shard(shard: dict[str, torch.Tensor], path: Path, weight_map: dict[str, str]) -> None:
    save_file(shard, str(path), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, path.name))
