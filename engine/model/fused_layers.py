"""A decode step's decoder layers in one kernel call (``decode_layers``,
``engine/kernels/cpu/decode_layers.cpp``), where the model is that kernel's case.

At one to a few decode rows the Python around a layer's nine kernels (the modules'
forwards, a kernel choice per call, ~270 dispatches a step) cost the default model's
one-row step ~1.7 ms of ~7.7 (with the op: 0.77x the step's time, alternating in-process
runs on a 2-core Zen 4; 0.87x on SmolLM2-360M's shapes, 0.89x at 4 rows);
the op runs the same kernels in the same order, so a row gets the same bits. The case: a
float32 model, every layer's four linear layers on pdserve's int4 kernel (GGUF Q4 or Q8_0
blocks, ``--quantization int4`` or ``int8``; int8 as two nibble planes) with no bias and no adapters, no per-head norms (Qwen3), and, per
step, pdserve's rotary + store and decode attention (``FusedCpuBackend``) with every linear
layer on its packed kernel at the step's rows (not its many-rows GEMM). Anything else runs
the layers one by one (``CausalLM.hidden``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.weights.linear import Int4Kernel, Int8Kernel, Linear

if TYPE_CHECKING:
    from engine.model.causal_lm import CausalLM


@dataclass(frozen=True)
class LayerStack:
    """What ``decode_layers`` takes of a model, gathered once."""

    tiles: list[torch.Tensor]  # per layer: qkv, o, gate_up, down (packed tiles)
    outs: list[int]  # their output widths (the same every layer)
    # per layer: its post-attention norm's weight, then the next layer's input norm's (the
    # last layer: the model's final norm)
    norms: list[torch.Tensor]
    eps: float
    amx: bool  # the int4 kernel's AMX variant (int4_tiles.kernel_name)
    a8: bool  # its ``avx512_vnni`` variant: int8 inputs (int4_tiles.kernel_name)
    planes: list[int]  # per kind: 1 where int8 (two nibble planes, the input twice), else 0
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Layer 0's four kernels: whether a call of T rows takes their packed kernel (every
    # layer's crossover is the same per shape, ``_Loader.set_crossovers``).
    first: tuple[Int4Kernel | Int8Kernel, ...]

    def packed_at(self, h: torch.Tensor) -> bool:
        """Whether every linear layer takes its packed kernel for ``h``'s rows (not its
        many-rows GEMM: a prefill's, or a large decode batch's; nor its prompt kernel)."""
        return all(
            (k.many_rows is None or not k.many_rows.serves(h)) and k.call_kernel() == k.kernel
            for k in self.first
        )


def layer_stack(model: CausalLM) -> LayerStack | None:
    """``model``'s layers for ``decode_layers``, or None where they are not its case."""
    layers = [model.layer(i) for i in range(len(model.layers))]
    linears: list[list[Linear]] = [
        [layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down] for layer in layers
    ]
    kernels = [[lin.kernel for lin in four] for four in linears]
    packed = [k for k in kernels[0] if isinstance(k, Int4Kernel | Int8Kernel)]
    if len(packed) != 4 or len({k.kernel for k in packed}) != 1 or packed[0].kernel == "torch":
        return None
    tiles = []
    for four, ks in zip(linears, kernels, strict=True):
        for lin, k, k0 in zip(four, ks, packed, strict=True):
            if type(k) is not type(k0) or not isinstance(k, Int4Kernel | Int8Kernel):
                return None
            if k.kernel != k0.kernel or k.shape != k0.shape:
                return None
            if lin.bias is not None or lin.lora is not None:
                return None
            rows = (k.many_rows.min_rows, k.many_rows.by_phase) if k.many_rows else None
            rows0 = (k0.many_rows.min_rows, k0.many_rows.by_phase) if k0.many_rows else None
            if rows != rows0:
                return None
            tiles.append(k.planes.tiles if isinstance(k, Int8Kernel) else k.tiles)
    if any(layer.attn.q_norm is not None for layer in layers):
        return None
    post = [layer.post_attn_norm for layer in layers]
    after = [layer.input_norm for layer in layers[1:]] + [model.norm]
    norms = [w for pair in zip(post, after, strict=True) for w in pair]
    if len({n.eps for n in norms}) != 1 or any(n.weight.dtype != torch.float32 for n in norms):
        return None
    attn = layers[0].attn
    return LayerStack(
        tiles=tiles,
        outs=[k.out_features for k in packed],
        norms=[n.weight for n in norms],
        eps=norms[0].eps,
        amx=packed[0].kernel == "amx",
        a8=packed[0].kernel == "avx512_vnni",
        planes=[int(isinstance(k, Int8Kernel)) for k in packed],
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        first=tuple(packed),
    )
