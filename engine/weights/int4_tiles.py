"""pdserve's int4 kernel for decode batches: one decode of the weights for up to 16 rows.

torch's CPU int4 kernel de-quantizes per row block, so on a 2-core Xeon a step's layers
cost 2.5x at 8 rows what they cost at one, and 2.1x at 5 (a speculative verification of
4 drafts). This kernel (``engine/kernels/cpu/int4_mm.cpp`` and ``int4_amx.cpp``, built by
``make setup``) decodes each weight once per 16 rows and multiplies on the AMX tile unit
where the CPU has one (1.4x at 8 rows), else with AVX-512 BF16 pair-dots (on a 2-core Zen 5: 1.4x at 8 rows, 1.7x at 5). On AMX the same tiles also serve calls of many rows
(``TilesGemm``: prefills, large decode batches), de-quantizing each weight once per call
into bfloat16 tiles, where a bfloat16 copy of the weights (two bytes a weight) served them
before. Measured: ``benchmarks/results/linear_kernels.md``.

Kernels, by ``kernel_name()`` (``PDSERVE_INT4_KERNEL`` picks one; unset: the first of
them that runs here):

* ``amx``: tiles, on CPUs with AMX-BF16 (Sapphire Rapids and later);
* ``avx512_vnni``: the same tiles with each row's inputs quantized to int8 per group of 32
  (as llama.cpp's Q4 x Q8_1 dot products) and the codes multiplied as bytes
  (``int4_gemm_a8``: AVX-512 VNNI, 64 products an instruction where pair-dots take 32),
  on CPUs with AVX-512 BF16 and VNNI (Zen 4/5). Not the same numbers as the others: each
  input carries up to half a step of its group's int8 scale. On a 2-core Zen 5 a step's
  layers take 0.94x ``avx512_bf16``'s time at 1 row, 0.84x at 5 and 0.79x at 8; the LM
  head stays on ``avx512_bf16`` (``head_kernel``), so logits and logprobs see bfloat16
  inputs, and so do prefill forwards (``Int4Kernel.prompt_kernel``); measured:
  ``benchmarks/results/decode_int8_inputs.md``;
* ``avx512_bf16``: vector pair-dots (AVX-512 BF16: Zen 4/5, Cooper Lake). On a 2-core
  AMD EPYC (Zen 5) one step's layers cost 0.88x torch's kernel at 1 row, 0.58x at 5,
  0.70x at 8 and 0.57x at 32; on the Xeon above it only matches torch's (one pair-dot a
  cycle is that core's float32 FMA rate), where ``amx`` comes first anyway;
* ``torch``: ``torch._weight_int4pack_mm_for_cpu``, for every other CPU, or when the
  library was not built. The tests run each one this CPU can.

``amx`` and ``avx512_bf16`` compute ``x W^T`` on bfloat16 inputs with float32 sums, scaling
each group of 32 once (``engine/kernels/cpu/``); each gives a row the same bits whatever
the rows beside it and the threads, so a decode step's rows and a verification's agree. Between
kernels the bits differ.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from engine.direct_attrs import DirectAttrs
from engine.kernels.cpu import ops
from engine.weights.quant import GROUP, Int4Rows

logger = logging.getLogger(__name__)

KERNELS = ("amx", "avx512_vnni", "avx512_bf16", "torch")
_TILE = 16  # outputs per tile
_GROUP_BYTES = GROUP * _TILE // 2 + 4 * _TILE  # codes, then scale and offset as float16


class Int4KernelUnavailable(RuntimeError):
    """The int4 kernel asked for cannot run here; the message says why."""


def kernel_name() -> str:
    """The int4 kernel packed layers use in this process (``KERNELS``)."""
    return _resolve(os.environ.get("PDSERVE_INT4_KERNEL", "auto").lower())


def bfloat16_inputs(name: str) -> str:
    """The kernel on the same tiles as ``name`` that takes bfloat16 inputs: ``name`` itself
    but for ``avx512_vnni`` (int8 inputs), whose is ``avx512_bf16``."""
    return "avx512_bf16" if name == "avx512_vnni" else name


def head_kernel() -> str:
    """The int4 kernel of an LM head: this process's with bfloat16 inputs, so the logits
    carry no rounding of their inputs beyond bfloat16."""
    return bfloat16_inputs(kernel_name())


def available_kernels() -> list[str]:
    """Every kernel of ``KERNELS`` that runs on this CPU, fastest first."""
    out = []
    for name in KERNELS:
        try:
            out.append(_resolve(name))
        except Int4KernelUnavailable:
            continue
    return out


@functools.cache
def _resolve(requested: str) -> str:
    if requested == "torch":
        return "torch"
    if requested not in ("auto", *KERNELS):
        raise Int4KernelUnavailable(
            f"PDSERVE_INT4_KERNEL={requested!r}: expected one of auto, {', '.join(KERNELS)}"
        )
    for name in KERNELS[:-1] if requested == "auto" else (requested,):
        try:
            ops.load()
            _probe(name)
            return name
        except (Int4KernelUnavailable, RuntimeError) as e:
            if requested != "auto":
                raise Int4KernelUnavailable(f"int4 kernel {name!r}: {e}") from e
            logger.info("int4 kernel %s does not run here: %s", name, e)
    return "torch"


def _probe(name: str) -> None:
    """One small product checked against float32, so a kernel that loads but cannot run
    here (the OS refused the tile state) is never chosen."""
    if name == "amx" and not torch.cpu._is_amx_tile_supported():
        raise Int4KernelUnavailable("this CPU has no AMX")
    if name == "avx512_vnni":
        _probe_a8()
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 2 * GROUP), dtype=torch.uint8, generator=gen)
    rows = Int4Rows(codes, torch.full((16, 2), 0.5), torch.full((16, 2), -1.0))
    x = torch.randn(3, 2 * GROUP, generator=gen).to(torch.bfloat16)
    got = torch.ops.pdserve.int4_mm(x, pack(rows), 16, name == "amx")
    want = x.float() @ rows.dequantize().T
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
        raise Int4KernelUnavailable("its probe product is wrong")


def pack(rows: Int4Rows) -> torch.Tensor:
    """``rows`` (N, K) in the kernel's layout: uint8 (ceil(N / 16), K / 32, 320).

    Tile t holds outputs 16t..16t+15 (padding: code 0, scale 0, offset 0, so weight 0);
    per group, 256 bytes of codes then the scale and the offset ``zero - 8 scale`` as
    float16 (``W = c scale + offset``; exact for GGUF's Q4_0 and Q4_1, whose d and m are
    float16). Code bytes: 8 chunks of 32, byte 2i + j of chunk q holding output i's code for
    input 2q + j in its low nibble and for input 16 + 2q + j in its high one.
    """
    n, k = rows.codes.shape
    if k % GROUP:
        raise ValueError(f"input width {k} is not a multiple of {GROUP}")
    groups, pad = k // GROUP, -n % _TILE
    codes, scale = rows.codes, rows.scale
    offset = rows.zero - 8.0 * rows.scale
    if pad:
        codes = F.pad(codes, (0, 0, 0, pad))
        scale, offset = F.pad(scale, (0, 0, 0, pad)), F.pad(offset, (0, 0, 0, pad))
    tiles = codes.shape[0] // _TILE
    c = codes.view(tiles, _TILE, groups, GROUP).transpose(1, 2)  # (T, G, 16 outputs, 32)
    # (T, G, 16, 16) -> (T, G, 8 chunks, 16 outputs, 2 inputs)
    lo = c[..., : GROUP // 2].unflatten(-1, (8, 2)).transpose(2, 3)
    hi = c[..., GROUP // 2 :].unflatten(-1, (8, 2)).transpose(2, 3)
    code_bytes = (lo | (hi << 4)).reshape(tiles, groups, GROUP * _TILE // 2)

    def halves(v: torch.Tensor) -> torch.Tensor:  # (N, G) -> (T, G, 32) bytes of float16
        return v.half().view(tiles, _TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((code_bytes, halves(scale), halves(offset)), dim=-1).contiguous()


def mm(x: torch.Tensor, tiles: torch.Tensor, n: int, kernel: str) -> torch.Tensor:
    """``x`` (T, K), float32 or bfloat16 (float32 is rounded to bfloat16 first), times the
    packed weight's transpose: (T, n) float32."""
    if kernel == "avx512_vnni":
        return torch.ops.pdserve.int4_gemm_a8(x, tiles, n)
    return torch.ops.pdserve.int4_mm(x, tiles, n, kernel == "amx")


class TilesGemm(DirectAttrs):
    """The many-rows GEMM of a layer packed for the ``amx`` kernel, on its own tiles: each
    call de-quantizes every weight once to bfloat16 and multiplies all its rows on the tile
    unit (``int4_gemm`` in ``engine/kernels/cpu/int4_amx.cpp``), so it needs no bfloat16
    copy of the weights.
    Numerically a bfloat16 GEMM, as the copies it replaces: bfloat16 weights and inputs,
    float32 sums. ``repeat``: the input is given twice side by side (an int8 layer's two
    nibble planes, ``Int8Kernel``, each rounded to bfloat16 apart: about 1.4x the error of
    one bfloat16 copy). x: (T, K) -> (T, n)."""

    compute_dtype = torch.float32
    op_name = "int4_gemm"  # in torch.ops.pdserve: (x (M, K), tiles, n) -> (M, n) float32

    def __init__(self, tiles: torch.Tensor, n: int, repeat: bool = False) -> None:
        super().__init__()
        self.register_buffer("tiles", tiles, persistent=False)
        self.tiles: torch.Tensor
        self.n, self.repeat = n, repeat
        self._op = getattr(torch.ops.pdserve, self.op_name)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.repeat:
            xb = torch.cat((xb, xb), dim=1)
        return self._op(xb, self.tiles, self.n).to(out_dtype or x.dtype)


def a8_supported() -> bool:
    """Whether ``A8Gemm`` runs here: the library built, AVX-512 VNNI, and its probe right."""
    try:
        _probe_a8()
    except (Int4KernelUnavailable, RuntimeError) as e:
        logger.info("the int8-input GEMM does not run here: %s", e)
        return False
    return True


@functools.cache
def _probe_a8() -> None:
    ops.load()
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 2 * GROUP), dtype=torch.uint8, generator=gen)
    rows = Int4Rows(codes, torch.full((16, 2), 0.5), torch.full((16, 2), -1.0))
    x = torch.randn(3, 2 * GROUP, generator=gen)
    got = torch.ops.pdserve.int4_gemm_a8(x, pack(rows), 16)
    want = x @ rows.dequantize().T
    # int8 inputs: within a few steps of 1/127 of each group's largest input.
    if not torch.allclose(got, want, rtol=0.05, atol=0.5):
        raise Int4KernelUnavailable("its probe product is wrong")


class A8Gemm(TilesGemm):
    """The many-rows GEMM of a layer packed for the ``avx512_bf16`` kernel, on its own tiles,
    with int8 inputs (``int4_gemm_a8`` in ``engine/kernels/cpu/int4_a8.cpp``): each row's inputs quantized per
    group of 32 as llama.cpp's Q4 x Q8_1 products do (``d = max |x| / 127``), the codes
    multiplied as bytes (AVX-512 VNNI, 64 products an instruction where bfloat16 pair-dots
    take 32), each group's sum scaled once. No copy of the weights. Not a bfloat16 GEMM:
    each input carries up to half a step of its group's ``d`` (about 0.8 % relative error
    on a product of random rows, against 0.2 % for bfloat16); the perplexity it costs is in
    ``benchmarks/results/perplexity.md``. ``repeat``: as ``TilesGemm``. x: (T, K) -> (T, n)."""

    op_name = "int4_gemm_a8"


GEMM_INPUTS = ("bfloat16", "int8")


def gemm_inputs(requested: str) -> str:
    """What the many-rows GEMM of packed layers feeds their weights: ``bfloat16`` (the
    default: the bfloat16 GEMMs of ``engine/weights/gemm.py``, or ``TilesGemm`` on AMX) or
    ``int8`` (``A8Gemm``: on a 2-core Zen 5 a step's layers take 0.72x the bfloat16 GEMM's
    time at 256 rows, for +0.39 % perplexity on SmolLM2; ``benchmarks/results/``
    ``linear_kernels.md`` and ``perplexity.md``). Raises ``Int4KernelUnavailable`` for
    ``int8`` where it cannot run."""
    if requested not in GEMM_INPUTS:
        raise Int4KernelUnavailable(
            f"GEMM inputs {requested!r}: expected one of {', '.join(GEMM_INPUTS)}"
        )
    if requested == "int8" and (kernel_name() == "torch" or not a8_supported()):
        raise Int4KernelUnavailable(
            "int8 GEMM inputs need pdserve's int4 kernel (built, on an AVX-512 BF16 CPU) and "
            f"AVX-512 VNNI; this process runs the {kernel_name()} int4 kernel"
        )
    return requested
