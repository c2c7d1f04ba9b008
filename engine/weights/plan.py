"""Which weight storage and activation dtype a worker serves with: one decision, made
from the flags and the checkpoint, shared by the launcher (which sizes the KV pools in
that dtype) and the engine (which loads the weights that way).

``--quantization``:
* ``auto`` (default): a checkpoint converted from a GGUF file serves the file's Q4_0, Q4_1
  and Q8_0 blocks packed, exactly as stored (``gguf``); a GGUF with none of those, and any
  other checkpoint, as ``none``;
* ``none``: dense weights in ``--dtype`` (float32 on CPU unless asked otherwise);
* ``int8`` / ``int4``: weight-only, groups of 32, quantized at load from the checkpoint's
  own values (int4 asymmetric, as Q4_1; int8 symmetric, as Q8_0). The LM head and the
  embedding stay int8 under ``int4``: a small model's next-token choice is sensitive there.

Packed kernels compute in bfloat16 (``kernel_dtype``): torch's int4 kernel is 10-50x slower
fed float32. Only the linear layers do: each casts its input to bfloat16 and its output
back, while the residual stream, norms, rotary, attention and the KV cache stay in the
model's dtype (float32 on CPU). Running the whole model in bfloat16 (``--dtype bfloat16``)
is possible, but on SmolLM2 it changed greedy answers that bfloat16 at the linear layers
alone keeps. The KV cache is bfloat16 too (``cache_dtype``). Packed kernels run on CPU only
for now.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import torch_dtype

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "int8", "int4")
# Written by the GGUF converter beside the checkpoint it makes: where the blocks came from.
GGUF_SOURCE_FILE = "gguf_source.json"


class QuantizationError(ValueError):
    """The asked-for quantization cannot be served here; the message says why."""


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted checkpoint came from, if it still exists."""
    record = model_dir / GGUF_SOURCE_FILE
    if not record.exists():
        return None
    path = Path(json.loads(record.read_text())["path"])
    if not path.is_file():
        logger.warning("%s: its source %s is gone; serving the de-quantized copy", model_dir, path)
        return None
    return path


def resolve_quantization(requested: str, model_dir: Path, device: str) -> str:
    """``none``, ``int8``, ``int4`` or ``gguf`` (serve the source GGUF's blocks packed)."""
    if requested not in QUANTIZATIONS:
        raise QuantizationError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {requested!r}"
        )
    on_cpu = str(device).split(":")[0] == "cpu"
    if requested == "auto":
        source = gguf_source(model_dir)
        if source is None:
            return "none"
        if not _has_packable_tensors(source):
            # Nothing to pack (an F32/F16/K-quant file): serve its exact de-quantized copy
            # as any dense checkpoint, float32 KV cache included.
            return "none"
        if not on_cpu:
            logger.info("packed GGUF weights run on CPU only: de-quantizing them for %s", device)
            return "none"
        return "gguf"
    if requested != "none" and not on_cpu:
        raise QuantizationError(
            f"--quantization {requested} runs on CPU only for now; on {device} serve "
            "--quantization none (with --dtype bfloat16 or float16)"
        )
    return requested


def packable_gguf_types() -> frozenset[int]:
    """GGUF block types whose blocks are one of ``engine.weights.quant``'s packed row
    kinds, exactly (Q4_0, Q4_1, Q8_0)."""
    from gguf import GGMLQuantizationType as Q

    return frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0})


def _has_packable_tensors(path: Path) -> bool:
    """Whether the GGUF file holds any Q4_0/Q4_1/Q8_0 tensor (read from its header).

    NOTE: the header alone, with string arrays skipped (``engine/gguf_reader.py``): the
    launcher asks this several times before it starts anything, and ``gguf.GGUFReader``
    takes ~3 s a time on SmolLM2's file on a 2-core host (it builds a numpy view per
    vocabulary entry), against ~15 ms here."""
    from engine.gguf_reader import GGUFHeader

    packable = packable_gguf_types()
    return any(t.qtype in packable for t in GGUFHeader(path).tensors.values())


def cache_dtype_name(activations: str, quantization: str) -> str:
    """The KV cache's dtype, by name. Quantized serving keeps K and V in bfloat16 beside a
    float32 residual stream: decode attention reads the whole context every step, from
    memory (the weights streamed in between evict it from cache), so half the bytes is
    most of its time; K and V are rounded once, on the way in."""
    return "bfloat16" if quantization != "none" and activations == "float32" else activations


def cache_dtype(activations: torch.dtype, quantization: str) -> torch.dtype:
    """``cache_dtype_name`` for torch dtypes."""
    name = str(activations).removeprefix("torch.")
    return torch_dtype(cache_dtype_name(name, quantization))


def kernel_dtype(activations: torch.dtype) -> torch.dtype:
    """What a packed linear layer computes in, for a model whose activations are these."""
    import torch

    return torch.bfloat16 if activations == torch.float32 else activations
