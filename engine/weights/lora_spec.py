"""A PEFT LoRA directory, read and checked without torch: what the frontend validates
before it registers an adapter, and what the engine reads before it loads one.

A directory is ``adapter_config.json`` + ``adapter_model.safetensors``. Served: plain
LoRA on any subset of the decoder's seven projections (q/k/v/o, gate/up/down), its own
rank ``r`` and ``lora_alpha``; scaling ``alpha / r``, or ``alpha / sqrt(r)`` with
``use_rslora``. Refused, each with a ``LoraError`` naming it: DoRA, trained biases,
``modules_to_save``, embedding or head targets, per-module rank or alpha patterns,
pickled weights, any tensor the served math would not use (nothing is silently dropped).

Tensor names (PEFT's): ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight``
(r, in_features) and ``...lora_B.weight`` (out_features, r).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)
_FLOAT_DTYPES = ("F32", "F16", "BF16")
# Options whose non-default value changes the math served here: refused, named.
_REFUSED_OPTIONS: tuple[tuple[str, object, str], ...] = (
    ("use_dora", False, "DoRA adapters (use_dora) are not served"),
    ("lora_bias", False, "adapters with a trained bias (lora_bias) are not served"),
    ("fan_in_fan_out", False, "fan_in_fan_out (Conv1D) adapters are not served"),
    ("layer_replication", None, "layer_replication is not served"),
    ("use_qalora", False, "QA-LoRA adapters are not served"),
)


class LoraError(ValueError):
    """An adapter that cannot be served on this base; the message names the problem."""


@dataclass(frozen=True)
class BaseDims:
    """The base model's projection widths, from its config.json."""

    hidden: int
    intermediate: int
    q_size: int
    kv_size: int
    num_layers: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BaseDims:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            q_size=heads * head_dim,
            kv_size=kv_heads * head_dim,
            num_layers=int(config["num_hidden_layers"]),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> BaseDims:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def in_out(self, target: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_size, self.kv_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[target]


@dataclass(frozen=True)
class LoraSpec:
    """What a PEFT directory holds, as read from its config and safetensors header."""

    path: str
    rank: int
    alpha: float
    scaling: float
    targets: tuple[str, ...]
    # tensor name -> (layer, target, "A" | "B", shape)
    tensors: tuple[tuple[str, int, str, str, tuple[int, ...]], ...]
    fingerprint: str  # hex digest of the config and the weights' bytes

    def check_fits(self, base: BaseDims, max_rank: int) -> None:
        """Raise ``LoraError`` if this adapter's rank or shapes do not fit ``base``."""
        if self.rank > max_rank:
            raise LoraError(f"{self.path}: rank {self.rank} exceeds --max-lora-rank {max_rank}")
        for name, layer, target, which, shape in self.tensors:
            if layer >= base.num_layers:
                raise LoraError(
                    f"{self.path}: {name} is for layer {layer}; the base has "
                    f"{base.num_layers} layers"
                )
            k, n = base.in_out(target)
            want = (self.rank, k) if which == "A" else (n, self.rank)
            if shape != want:
                raise LoraError(
                    f"{self.path}: {name} has shape {list(shape)}; this base "
                    f"needs {list(want)} (rank {self.rank})"
                )


def read_lora(path: str | Path) -> LoraSpec:
    """Read and check a PEFT LoRA directory; raise ``LoraError`` naming what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"{root}: no such adapter directory")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file():
        raise LoraError(f"{root}: not a LoRA adapter (no {CONFIG_FILE})")
    if not weights_path.is_file():
        other = (
            " (pickled adapter_model.bin is refused)"
            if (root / "adapter_model.bin").exists()
            else ""
        )
        raise LoraError(f"{root}: no {WEIGHTS_FILE}{other}")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise LoraError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{config_path}: not a JSON object")
    rank, alpha, scaling, targets = _check_config(root, config)
    tensors = _read_header(weights_path)
    seen = {t for _, _, t, _, _ in tensors}
    if not tensors:
        raise LoraError(f"{weights_path}: holds no LoRA tensors")
    if seen - set(targets):
        raise LoraError(
            f"{weights_path}: tensors for {sorted(seen - set(targets))}, "
            "which target_modules does not name"
        )
    return LoraSpec(
        path=str(root),
        rank=rank,
        alpha=alpha,
        scaling=scaling,
        targets=tuple(sorted(seen, key=TARGETS.index)),
        tensors=tensors,
        fingerprint=_fingerprint(config_bytes, weights_path),
    )


def _check_config(root: Path, c: dict[str, Any]) -> tuple[int, float, float, tuple[str, ...]]:
    if str(c.get("peft_type", "")).upper() != "LORA":
        raise LoraError(f"{root}: peft_type is {c.get('peft_type')!r}, not LORA")
    for key, default, message in _REFUSED_OPTIONS:
        if c.get(key) not in (default, None):
            raise LoraError(f"{root}: {message}")
    if c.get("bias", "none") != "none":
        raise LoraError(f"{root}: bias={c.get('bias')!r}: trained biases are not served")
    if c.get("modules_to_save"):
        raise LoraError(
            f"{root}: modules_to_save {c.get('modules_to_save')} is not served "
            "(fully trained copies of base modules)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            raise LoraError(f"{root}: {key} (per-module rank or alpha) is not served")
    if c.get("trainable_token_indices"):
        raise LoraError(f"{root}: trainable_token_indices (embedding rows) is not served")
    raw = c.get("target_modules")
    if isinstance(raw, str) or not isinstance(raw, list) or not raw:
        raise LoraError(f"{root}: target_modules must be a list of module names, not {raw!r}")
    unknown = [t for t in raw if t not in TARGETS]
    if unknown:
        raise LoraError(
            f"{root}: target modules {unknown} are not served; LoRA may target {', '.join(TARGETS)}"
        )
    try:
        rank, alpha = int(c["r"]), float(c.get("lora_alpha", c["r"]))
    except (KeyError, TypeError, ValueError):
        raise LoraError(f"{root}: r and lora_alpha must be numbers") from None
    if rank < 1:
        raise LoraError(f"{root}: rank r must be >= 1, not {rank}")
    scaling = alpha / math.sqrt(rank) if c.get("use_rslora") else alpha / rank
    return rank, alpha, scaling, tuple(raw)


def _read_header(path: Path) -> tuple[tuple[str, int, str, str, tuple[int, ...]], ...]:
    """The safetensors header's LoRA tensors, in key order; refuses any other tensor."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise LoraError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise LoraError(f"{path}: not a safetensors file") from None
    if not isinstance(header, dict):
        raise LoraError(f"{path}: not a safetensors file")
    out = []
    for name, info in sorted(header.items()):
        if name == "__metadata__":
            continue
        m = _KEY.match(name)
        if m is None:
            raise LoraError(
                f"{path}: tensor {name!r} is not a LoRA A/B of a served "
                "projection (embeddings, heads, DoRA magnitudes, biases are refused)"
            )
        if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES:
            raise LoraError(f"{path}: tensor {name!r} is not float32/float16/bfloat16")
        shape = tuple(int(d) for d in info.get("shape", ()))
        if len(shape) != 2:
            raise LoraError(f"{path}: tensor {name!r} has shape {list(shape)}, not 2-D")
        out.append((name, int(m.group(1)), m.group(2), m.group(3), shape))
    pairs = {(layer, t) for _, layer, t, _, _ in out}
    for layer, t in pairs:
        have = {w for _, ly, tt, w, _ in out if (ly, tt) == (layer, t)}
        if have != {"A", "B"}:
            raise LoraError(f"{path}: layer {layer} {t} has lora_{''.join(have)} without its pair")
    return tuple(out)


def _fingerprint(config_bytes: bytes, weights_path: Path) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"pdserve-lora")
    h.update(len(config_bytes).to_bytes(8, "little") + config_bytes)
    with weights_path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
