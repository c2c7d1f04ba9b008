"""The model's linear layers and token embedding, with their storage chosen at load.

The model code calls ``Linear`` and ``Embedding`` and never asks how the weight is held:
the loader gives each one a kernel (``engine/checkpoint/loader.py``), one class per kind:

* ``DenseKernel``: the weight in the activation dtype, ``F.linear``;
* ``Int4Kernel``: int4 codes with a scale and zero per group of 32 inputs, packed for
  pdserve's int4 kernel where the CPU runs it (``engine/weights/int4_tiles.py``: AMX or
  AVX-512 BF16), else for torch's CPU weight-only kernel (``_weight_int4pack_mm_for_cpu``);
* ``Int8Kernel``: int8 codes in groups of 32 (Q8_0) on the same int4 kernel, exactly:
  ``q = 16 h + l`` with ``h = q >> 4`` in [-8, 7] and ``l = q & 15`` in [0, 15], so
  ``x . (q d) = x . (h 16d) + x . (l d)``: two nibble planes side by side along the input
  dimension (``[hi | lo]``, 2K columns) with the input repeated, one kernel call.
  torch's own int8 kernel takes one scale per output channel, not per group.

A packed layer may also hold its weights in bfloat16 for calls of many rows
(``with_gemm``, ``engine/weights/gemm.py``): prefill forwards (``prefill_phase``) always
run that GEMM, and decode steps from ``min_rows`` rows on, measured per machine. Prefill by
phase, not by rows: a prompt's KV must not depend on how it was split (a prefix-cache hit,
chunking) or on the prompts that shared its batch (both GEMMs give each row the same bits
whatever the rows beside it). A decode step's kernel does depend on its batch size, so a
row's logits can differ in their last bits with the batch it ran in. The LM head goes by
rows in prefill too (``by_phase=False``): it writes no KV, and a prefill gives it one row
per prompt, so a prompt's first-token logits can differ in their last bits with the
number of prompts that shared its prefill (greedy choices do not: ``RefinedHead``).

Every kernel's ``forward(x, bias, out_dtype=None)`` returns ``out_dtype`` (None: x's);
its ``native(x)`` returns the product in the dtype it comes out in before that cast (the
packed kernel's ``compute_dtype``, or the many-rows GEMM's, by the call's rows): a
consumer that would round to it anyway, or widens it exactly, takes that
(``Linear.native``) and skips a round trip.

Packed kernels run on CPU only (torch's CUDA int4 layout differs and is untested here):
``check_device`` refuses them elsewhere with a clear error.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from engine.direct_attrs import DirectAttrs
from engine.weights import int4_tiles
from engine.weights.lora import AdapterBank
from engine.weights.quant import GROUP, Int4Rows, Int8Rows, QuantRows
from engine.weights.refined_head import RefinedHead
from engine.weights.row_tiles import tiled_linear

# torch's CPU int4 packing wants output rows in multiples of 16.
_ROW_MULTIPLE = 16
# Set while a prefill forward runs (``prefill_phase``): packed layers with a GEMM run it
# for every call then, whatever its rows.
_PREFILL = contextvars.ContextVar("prefill_phase", default=False)


# Set while a forward runs several rows per sequence as a decode would run one (speculative
# verification): kernels are chosen by its sequences, as for that decode step, so its rows
# get the bits the step would give them.
_DECODE_ROWS = contextvars.ContextVar("decode_rows", default=0)


@contextmanager
def prefill_phase() -> Iterator[None]:
    token = _PREFILL.set(True)
    try:
        yield
    finally:
        _PREFILL.reset(token)


@contextmanager
def decode_rows(n: int) -> Iterator[None]:
    """Choose packed-or-GEMM as for a decode step of ``n`` rows, whatever the call's rows."""
    token = _DECODE_ROWS.set(n)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


class QuantizationUnsupported(ValueError):
    """A quantized kind was asked for where no kernel of that kind runs."""


class DenseKernel(DirectAttrs):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.weight: torch.Tensor
        # Rows per GEMM call (``tiled_linear``); 0: one call, its kernel picked by its rows.
        self.row_tile = 0

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def input_dtype_for(self, x: torch.Tensor) -> torch.dtype:
        return self.weight.dtype

    def native(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x, None, self.compute_dtype)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        w = self.weight
        x = x if x.dtype == w.dtype else x.to(w.dtype)
        y = F.linear(x, w, bias) if not self.row_tile else tiled_linear(x, w, bias, self.row_tile)
        return y if out_dtype in (None, y.dtype) else y.to(out_dtype)


class ManyRows:
    """What a packed kernel holds for batches of many rows: a bfloat16 GEMM and the row
    count from which it is used (``engine/weights/gemm.py``). ``by_phase``: every call of
    a prefill forward takes the GEMM too (a layer's, whose output becomes KV); the LM
    head, which writes no KV (and in serving sees one row per prompt there), goes by rows
    alone."""

    def __init__(self, gemm: nn.Module, min_rows: int, by_phase: bool = True) -> None:
        self.gemm, self.min_rows, self.by_phase = gemm, min_rows, by_phase

    def serves(self, x: torch.Tensor) -> bool:
        if self.by_phase and _PREFILL.get():
            return True
        return (_DECODE_ROWS.get() or x.shape[0]) >= self.min_rows

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None
    ) -> torch.Tensor:
        out = self.gemm.forward(x, out_dtype)
        return out if bias is None else out.add_(bias)


class _PackedKernel(DirectAttrs):
    """What the packed kinds share: the bfloat16 GEMM for many rows (``with_gemm``) and the
    choice between it and ``packed_forward`` per call."""

    many_rows: ManyRows | None
    input_dtype: torch.dtype  # what the packed kernel rounds its input to
    compute_dtype: torch.dtype

    def per_row(self) -> None:
        """Every call, of any phase and rows, on the packed kernel: the arithmetic a row
        gets then does not depend on its step (``engine/model/batch_invariance.py``)."""
        self.many_rows = None

    def with_gemm(self, gemm: nn.Module, min_rows: int, by_phase: bool = True) -> None:
        """Run ``gemm`` (the same weights in bfloat16, (N, K)) for calls of ``min_rows`` rows
        or more: torch's int4 kernel de-quantizes per row block, so its cost grows with every
        row, while a bfloat16 GEMM is bound by reading the weights until far more rows."""
        self.many_rows = ManyRows(gemm, min_rows, by_phase)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if self.many_rows is not None and self.many_rows.serves(x):
            return self.many_rows(x, bias, out_dtype)
        return self.packed_forward(x, bias, out_dtype)

    def input_dtype_for(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the path of a call on ``x`` rounds x to before its product: bfloat16
        on every GEMM here, or the packed kernel's own (``input_dtype``)."""
        rows = self.many_rows
        if rows is not None and rows.serves(x):
            return torch.bfloat16
        return self.input_dtype

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` without a bias, in the dtype of the path the call takes: the GEMM's
        ``compute_dtype`` (bfloat16, but float32 from ``TilesGemm``) or this kernel's."""
        rows = self.many_rows
        if rows is not None and rows.serves(x):
            return rows.gemm.forward(x, rows.gemm.compute_dtype)
        return self.packed_forward(x, None, self.compute_dtype)

    def packed_forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        raise NotImplementedError


class Int4Kernel(_PackedKernel):
    """``y = x W^T`` with ``W = (c - 8) * scale + zero`` per group; x: (T, K) -> (T, N).

    Held in one of two layouts, by the kernel this process runs (``int4_tiles.kernel_name``):
    pdserve's tiles (``engine/weights/int4_tiles.py``: ``tiles``, float32 out) or torch's
    int4 packing (``packed`` and ``scales_zeros``, out in their dtype)."""

    def __init__(
        self, rows: Int4Rows, dtype: torch.dtype, device: torch.device, kernel: str | None = None
    ) -> None:
        """``kernel``: one of ``int4_tiles.available_kernels()`` on the tiles (the LM head's
        ``int4_tiles.head_kernel()``); None: this process's ``int4_tiles.kernel_name()``."""
        super().__init__()
        if device.type != "cpu":
            raise QuantizationUnsupported(f"packed int4 weights run on CPU only, not {device}")
        n, k = rows.codes.shape
        if k % GROUP:
            raise QuantizationUnsupported(f"input width {k} is not a multiple of {GROUP}")
        kernel = kernel or int4_tiles.kernel_name()
        if kernel != "torch":
            self._hold(kernel, (n, k), tiles=int4_tiles.pack(rows))
            return
        pad = -n % _ROW_MULTIPLE
        codes, scale, zero = rows.codes.to(torch.int32), rows.scale, rows.zero
        if pad:  # padded rows: code 8, scale 0, zero 0 -> weight 0; sliced off the output
            codes = F.pad(codes, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        # (K / GROUP, N, 2): the kernel's layout, in the activation dtype it requires.
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
        self._hold(kernel, (n, k), packed=packed, scales_zeros=sz)

    @classmethod
    def from_packed(
        cls, kernel: str, shape: tuple[int, int], **tensors: torch.Tensor
    ) -> Int4Kernel:
        """A kernel over tensors already in ``kernel``'s layout (``engine/checkpoint/image.py``):
        the same as the one that packed them, with no packing and no copy."""
        # The LM head's kernel may be another on the same tiles (``int4_tiles.head_kernel``).
        if kernel not in (int4_tiles.kernel_name(), int4_tiles.head_kernel()):
            raise QuantizationUnsupported(
                f"weights packed for the {kernel} int4 kernel; this process runs "
                f"{int4_tiles.kernel_name()}"
            )
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed._hold(kernel, shape, **tensors)
        return packed

    def _hold(self, kernel: str, shape: tuple[int, int], **tensors: torch.Tensor) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = shape
        self.shape = shape
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)
        self.tiles: torch.Tensor
        self.packed: torch.Tensor
        self.scales_zeros: torch.Tensor
        # The dtype the kernel reads its input in, and the one its product comes out in.
        if kernel == "torch":
            self.input_dtype = self.compute_dtype = self.scales_zeros.dtype
        else:
            self.input_dtype, self.compute_dtype = torch.bfloat16, torch.float32
        self.many_rows: ManyRows | None = None  # see with_gemm
        # The kernel a prefill forward's calls take, on the same tiles, where no GEMM takes
        # them: bfloat16 pair-dots where this one quantizes its inputs to int8, so a prompt
        # (which picks the first token, where near ties show most) is computed in bfloat16
        # as the GEMM would; None: this kernel. ``per_row`` drops it.
        prompt = int4_tiles.bfloat16_inputs(kernel)
        self.prompt_kernel = prompt if prompt != kernel else None

    def per_row(self) -> None:
        super().per_row()
        self.prompt_kernel = None

    def call_kernel(self) -> str:
        """The int4 kernel a call made now takes (``prompt_kernel`` in a prefill forward)."""
        if self.prompt_kernel is not None and _PREFILL.get():
            return self.prompt_kernel
        return self.kernel

    @staticmethod
    def roles(kernel: str) -> tuple[str, ...]:
        """The names of the tensors ``kernel``'s layout holds (what ``from_packed`` takes)."""
        return ("packed", "scales_zeros") if kernel == "torch" else ("tiles",)

    def layout(self) -> dict[str, torch.Tensor]:
        """The tensors this kernel computes from, by name."""
        return {role: getattr(self, role) for role in self.roles(self.kernel)}

    def packed_forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        dtype = out_dtype or x.dtype
        if self.kernel != "torch":
            # The kernel rounds float32 input to bfloat16 itself (as ``x.to`` would), in the
            # same pass as its group sums: one dispatch fewer a call.
            out = int4_tiles.mm(x, self.tiles, self.out_features, self.call_kernel())
        else:
            # torch's kernel computes in its scales' dtype (bfloat16 when serving: it is
            # 10-50x slower fed float32); the residual stream keeps its own dtype around it.
            out = torch._weight_int4pack_mm_for_cpu(
                x.to(self.compute_dtype), self.packed, GROUP, self.scales_zeros
            )
            if out.shape[1] != self.out_features:
                out = out[:, : self.out_features]
        out = out.to(dtype)
        return out if bias is None else out.add_(bias)


def nibble_planes(rows: Int8Rows) -> Int4Rows:
    """``rows`` (N, K) as the int4 rows (N, 2K) ``Int8Kernel`` packs: ``[hi | lo]``, each
    multiplied by the same input."""
    q = rows.codes.to(torch.int16)
    hi, lo = q >> 4, q & 15  # arithmetic shift: hi in [-8, 7]; q == 16 * hi + lo
    d = rows.scale
    return Int4Rows(
        codes=torch.cat((hi + 8, lo), dim=1).to(torch.uint8),  # (N, 2K)
        scale=torch.cat((16.0 * d, d), dim=1),
        zero=torch.cat((torch.zeros_like(d), 8.0 * d), dim=1),
    )


class Int8Kernel(_PackedKernel):
    """Group-wise int8 (``W = q * scale``) as two int4 nibble planes; x: (T, K) -> (T, N)."""

    def __init__(
        self, rows: Int8Rows, dtype: torch.dtype, device: torch.device, kernel: str | None = None
    ) -> None:
        super().__init__()
        planes = nibble_planes(rows)
        self._hold(Int4Kernel(planes, dtype, device, kernel), tuple(rows.codes.shape))

    @classmethod
    def from_planes(cls, planes: Int4Kernel, shape: tuple[int, int]) -> Int8Kernel:
        """A kernel over nibble planes already packed (``engine/checkpoint/image.py``)."""
        kernel = cls.__new__(cls)
        nn.Module.__init__(kernel)
        kernel._hold(planes, shape)
        return kernel

    def _hold(self, planes: Int4Kernel, shape: tuple[int, ...]) -> None:
        self.planes = planes
        self.kernel = planes.kernel  # the int4 kernel the planes run on
        self.input_dtype, self.compute_dtype = planes.input_dtype, planes.compute_dtype
        self.out_features, self.in_features = shape
        self.shape = (self.out_features, self.in_features)
        self.many_rows: ManyRows | None = None

    def per_row(self) -> None:
        super().per_row()
        self.planes.per_row()

    def call_kernel(self) -> str:
        return self.planes.call_kernel()

    def packed_forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        xc = x.to(self.input_dtype)  # before the repeat: half the bytes cast
        return self.planes.packed_forward(torch.cat((xc, xc), dim=1), bias, out_dtype or x.dtype)


# What a ``Linear`` holds: each has ``forward(x, bias, out_dtype)``, ``native(x)`` and
# ``input_dtype_for(x)``.
LinearKernel = DenseKernel | Int4Kernel | Int8Kernel | RefinedHead


def packed_kernel(
    rows: QuantRows, dtype: torch.dtype, device: torch.device, kernel: str | None = None
) -> Int4Kernel | Int8Kernel:
    if isinstance(rows, Int4Rows):
        return Int4Kernel(rows, dtype, device, kernel)
    return Int8Kernel(rows, dtype, device, kernel)


def tiles_gemm(kernel: Int4Kernel | Int8Kernel, inputs: str = "bfloat16") -> nn.Module:
    """The many-rows GEMM on a kernel's own tiles: on AMX in bfloat16 (``TilesGemm``), or
    with int8 inputs (``A8Gemm``, ``inputs="int8"``)."""
    planes = kernel.planes if isinstance(kernel, Int8Kernel) else kernel
    gemm = int4_tiles.A8Gemm if inputs == "int8" else int4_tiles.TilesGemm
    return gemm(planes.tiles, planes.out_features, isinstance(kernel, Int8Kernel))


class Linear(DirectAttrs):
    """``y = x W^T + b`` for x: (T, in_features); W's storage is the loader's choice."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False)
            if bias
            else None
        )
        self.kernel: LinearKernel | None = None  # set once by the loader
        # Adapters' low-rank updates (engine/weights/lora.py), when LoRA serving is on.
        self.lora: AdapterBank | None = None

    @property
    def kind(self) -> str:
        kernel = self.kernel.packed if isinstance(self.kernel, RefinedHead) else self.kernel
        return type(kernel).__name__.removesuffix("Kernel").lower()

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x (T, in_features) -> (T, out_features) in ``out_dtype`` (None: x's)."""
        assert self.kernel is not None, "weights not loaded"
        # NOTE: the kernel's forward, not its __call__: kernels carry no hooks, and a module
        # call costs ~0.6 us, paid ~240 times a decode step.
        y = self.kernel.forward(x, self.bias, out_dtype or x.dtype)
        return y if self.lora is None else self.lora(x, y)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """``forward``, its output left in the dtype the kernel's path computes it in
        (bfloat16 from torch's int4 kernel and the bfloat16 GEMMs, float32 from pdserve's
        int4 kernel): for a consumer that rounds to it anyway or computes from it in a wider
        dtype, so the values are the same with one cast (or two) fewer. With a bias or
        adapters the sum is rounded as ``forward`` rounds it."""
        assert self.kernel is not None, "weights not loaded"
        if self.bias is not None or self.lora is not None:
            return self.forward(x)
        return self.kernel.native(x)

    def input_dtype_for(self, x: torch.Tensor) -> torch.dtype:
        """The dtype ``forward(x)`` rounds x to before its product (x's own where adapters
        read x too): a producer of x may round to it itself, with the same bits."""
        assert self.kernel is not None, "weights not loaded"
        if self.lora is not None:
            return x.dtype
        return self.kernel.input_dtype_for(x)


class Embedding(DirectAttrs):
    """Token ids (T,) -> rows (T, dim) in the activation dtype; dense or group-quantized."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num, dim, dtype
        self.weight: torch.Tensor | None = None  # dense storage, or
        self.quant: QuantRows | None = None  # quantized rows, de-quantized per lookup

    def set_dense(self, weight: torch.Tensor) -> None:
        self.weight, self.quant = weight, None

    def set_quantized(self, rows: QuantRows) -> None:
        self.weight, self.quant = None, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        assert self.quant is not None, "weights not loaded"
        # Exact rows in float32, then the activation dtype: as a dense float32 table would.
        return self.quant.rows(ids).dequantize().to(self.dtype)
