"""Group-wise quantized weights as the packed kernels take them, and where they come from.

One representation per bit width, for rows of a weight matrix ``W`` (N, K) in groups of
``GROUP`` = 32 consecutive input columns (the block size of GGUF's Q4_0, Q4_1 and Q8_0):

* ``Int4Rows``: codes ``c`` in [0, 15], ``W[n, k] = (c[n, k] - 8) * scale[n, g] + zero[n, g]``,
  the form torch's int4 weight-only kernel evaluates. Q4_0 (``(c - 8) * d``) is
  ``scale = d, zero = 0``; Q4_1 (``c * d + m``) is ``scale = d, zero = m + 8 d``; both exact
  in float32 (d and m are float16, so ``m + 8 d`` needs no rounding).
* ``Int8Rows``: codes ``q`` in [-128, 127], ``W[n, k] = q[n, k] * scale[n, g]`` (Q8_0).

Scales and zeros are kept in float32 here, with float16 values (GGUF's, or rounded so by
``quantize_*``); a kernel casts them to the dtype it computes with.
``dequantize`` is the float32 reference every packed kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from engine.weights.plan import packable_gguf_types

GROUP = 32


@dataclass(frozen=True)
class Int4Rows:
    codes: torch.Tensor  # (N, K) uint8 in [0, 15]
    scale: torch.Tensor  # (N, K / GROUP) float32
    zero: torch.Tensor  # (N, K / GROUP) float32

    def rows(self, index: torch.Tensor) -> Int4Rows:
        return Int4Rows(self.codes[index], self.scale[index], self.zero[index])

    def dequantize(self) -> torch.Tensor:
        c = self.codes.float().unflatten(1, (-1, GROUP)) - 8.0  # (N, G, GROUP)
        return (c * self.scale[..., None] + self.zero[..., None]).flatten(1)


@dataclass(frozen=True)
class Int8Rows:
    codes: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N, K / GROUP) float32

    def rows(self, index: torch.Tensor) -> Int8Rows:
        return Int8Rows(self.codes[index], self.scale[index])

    def dequantize(self) -> torch.Tensor:
        q = self.codes.float().unflatten(1, (-1, GROUP))  # (N, G, GROUP)
        return (q * self.scale[..., None]).flatten(1)


QuantRows = Int4Rows | Int8Rows
# GGUF block types whose blocks are one of the representations above, exactly.
PACKABLE_GGUF_TYPES = packable_gguf_types()


def concat_rows(parts: list[QuantRows]) -> QuantRows | None:
    """Row-wise concatenation of same-kind parts (q, k, v into qkv); None if kinds differ.

    A single part is returned as it is (no copy): a tied embedding and LM head share it.
    """
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, Int4Rows) for p in parts):
        p4 = [p for p in parts if isinstance(p, Int4Rows)]
        return Int4Rows(*(torch.cat(t) for t in zip(*((p.codes, p.scale, p.zero) for p in p4))))
    if all(isinstance(p, Int8Rows) for p in parts):
        p8 = [p for p in parts if isinstance(p, Int8Rows)]
        return Int8Rows(torch.cat([p.codes for p in p8]), torch.cat([p.scale for p in p8]))
    return None


def from_gguf_blocks(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> QuantRows:
    """The rows of a Q4_0 / Q4_1 / Q8_0 tensor, read from its blocks without rounding.

    ``data``: the stored bytes, (N, bytes per row) uint8; ``shape``: (N, K). Block layouts
    (little-endian): Q4_0 = d f16, 16 bytes of nibbles; Q4_1 = d f16, m f16, 16 bytes of
    nibbles; Q8_0 = d f16, 32 int8. In a nibble block, byte j holds value j in its low
    nibble and value j + 16 in its high one.
    """
    n, k = shape
    if qtype not in PACKABLE_GGUF_TYPES:
        raise ValueError(f"{qtype.name} blocks do not map onto a packed kernel")
    blocks = np.ascontiguousarray(data).reshape(n, k // GROUP, -1)  # (N, G, block bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
    if qtype == Q.Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return Int8Rows(torch.from_numpy(q), torch.from_numpy(d))
    head = 2 if qtype == Q.Q4_0 else 4
    nib = blocks[..., head:]  # (N, G, 16)
    codes = np.concatenate((nib & 0x0F, nib >> 4), axis=-1).reshape(n, k)
    if qtype == Q.Q4_0:
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + np.float32(8.0) * d
    return Int4Rows(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def quantize_int4(w: torch.Tensor) -> Int4Rows:
    """Asymmetric int4 in groups of 32 (min/max grid: scale + offset, as Q4_1 does, both
    float16 as Q4_1 stores them, so every kernel holds the grid exactly)."""
    g = w.float().unflatten(1, (-1, GROUP))  # (N, G, GROUP)
    lo, hi = g.amin(-1).half().float(), g.amax(-1)
    scale = ((hi - lo) / 15.0).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - lo[..., None]) / safe[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    # c * scale + lo == (c - 8) * scale + (lo + 8 scale), exact in float32
    return Int4Rows(codes.flatten(1), scale, lo + 8.0 * scale)


def quantize_int8(w: torch.Tensor) -> Int8Rows:
    """Symmetric int8 in groups of 32 (absmax / 127 per group, float16, as Q8_0 does)."""
    g = w.float().unflatten(1, (-1, GROUP))  # (N, G, GROUP)
    scale = (g.abs().amax(-1) / 127.0).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / safe[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Rows(codes.flatten(1), scale)
