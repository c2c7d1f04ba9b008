"""Fill a ``CausalLM`` from a checkpoint: dense or packed, as the resolved quantization says.

Sources: a safetensors checkpoint (single file or sharded), or for ``gguf`` the GGUF file a
converted checkpoint came from, read block by block (``engine/checkpoint/gguf.py``). Checkpoint names
map onto the model's fused layers: q/k/v projections are row ranges of ``qkv``, gate/up of
``gate_up``. A ``Linear`` or ``Embedding`` gets its kernel once all its rows have arrived
(only one layer's parts are held at a time), chosen by ``_build``:

* ``none``: dense, in the activation dtype (quantized sources are de-quantized exactly);
* ``gguf``: the stored blocks packed when every part is Q4_0/Q4_1 (int4) or every part is
  Q8_0 (int8); otherwise de-quantized and dense, with a log line naming the types;
* ``int8`` / ``int4``: quantized from the float32 values (the head and embedding int8).
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.errors import UnsupportedModelError
from engine.model.causal_lm import CausalLM
from engine.weights import int4_tiles
from engine.weights.gemm import NEVER, bf16_gemm, min_gemm_rows
from engine.weights.linear import (
    DenseKernel,
    Embedding,
    Int4Kernel,
    Int8Kernel,
    Linear,
    LinearKernel,
    QuantizationUnsupported,
    packed_kernel,
    tiles_gemm,
)
from engine.weights.plan import gguf_source, kernel_dtype
from engine.weights.quant import QuantRows, concat_rows, quantize_int4, quantize_int8
from engine.weights.refined_head import RefinedHead

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = ("rotary_emb.inv_freq",)
Value = torch.Tensor | QuantRows


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


def _gguf_values(root: Path) -> Iterator[tuple[str, Value]]:
    from engine.checkpoint.gguf import (  # the gguf package: only when used
        GGUFCheckpoint,
        hf_tensors,
    )

    path = gguf_source(root)
    if path is None:
        raise UnsupportedModelError(f"{root}: no GGUF source file to read packed blocks from")
    config = json.loads((root / "config.json").read_text())
    unpacked: Counter[str] = Counter()
    for name, value, qtype in hf_tensors(GGUFCheckpoint(path), config, packed=True):
        if isinstance(value, torch.Tensor) and value.dim() > 1:
            unpacked[qtype] += 1
        yield name, value
    if unpacked:
        kinds = ", ".join(f"{n} {q}" for q, n in sorted(unpacked.items()))
        logger.info("%s: tensors of no packed format are de-quantized: %s", path.name, kinds)


_Target = tuple[nn.Module | torch.Tensor, int, int]


def _target(model: CausalLM, name: str) -> _Target | None:
    """The layer (or parameter) and row range a checkpoint tensor fills; None: no home."""
    if name == "model.embed_tokens.weight":
        return model.embed, 0, model.embed.num_embeddings
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
    bias = attn.qkv.bias
    table: dict[str, tuple[nn.Module | torch.Tensor | None, int, int]] = {
        "self_attn.q_proj.weight": (attn.qkv, 0, q),
        "self_attn.k_proj.weight": (attn.qkv, q, q + kv),
        "self_attn.v_proj.weight": (attn.qkv, q + kv, q + 2 * kv),
        "self_attn.q_proj.bias": (bias, 0, q),
        "self_attn.k_proj.bias": (bias, q, q + kv),
        "self_attn.v_proj.bias": (bias, q + kv, q + 2 * kv),
        "self_attn.o_proj.weight": (attn.o, 0, -1),
        "self_attn.q_norm.weight": (attn.q_norm.weight if attn.q_norm else None, 0, -1),
        "self_attn.k_norm.weight": (attn.k_norm.weight if attn.k_norm else None, 0, -1),
        "mlp.gate_proj.weight": (layer.mlp.gate_up, 0, inter),
        "mlp.up_proj.weight": (layer.mlp.gate_up, inter, 2 * inter),
        "mlp.down_proj.weight": (layer.mlp.down, 0, -1),
        "input_layernorm.weight": (layer.input_norm.weight, 0, -1),
        "post_attention_layernorm.weight": (layer.post_attn_norm.weight, 0, -1),
    }
    target, lo, hi = table.get(rest, (None, 0, 0))
    return None if target is None else (target, lo, hi)


def _rows(target: nn.Module | torch.Tensor) -> int:
    if isinstance(target, Linear):
        return target.out_features
    if isinstance(target, Embedding):
        return target.num_embeddings
    assert isinstance(target, torch.Tensor)
    return target.shape[0]


def _width(target: nn.Module | torch.Tensor) -> tuple[int, ...]:
    if isinstance(target, Linear):
        return (target.in_features,)
    if isinstance(target, Embedding):
        return (target.embedding_dim,)
    assert isinstance(target, torch.Tensor)
    return tuple(target.shape[1:])


def _shape(value: Value) -> tuple[int, ...]:
    return tuple(value.shape if isinstance(value, torch.Tensor) else value.codes.shape)


class _Loader:
    def __init__(
        self,
        model: CausalLM,
        quantization: str,
        gemm_rows: int | None,
        shareable: bool,
        gemm_inputs: str,
    ) -> None:
        self.model, self.quantization, self.gemm_rows = model, quantization, gemm_rows
        self.shareable, self.gemm_inputs = shareable, gemm_inputs
        # Packed layers with a GEMM, by (kernel kinds, N, K): their crossover is set once all
        # of them are loaded (``set_crossovers``), measured over all of them together.
        self.with_gemm: dict[tuple[str, int, int], list[Int4Kernel | Int8Kernel]] = {}
        self.crossovers: dict[tuple[str, int, int], int] = {}
        self.dtype = model.norm.weight.dtype
        self.device = model.norm.weight.device
        self.staged: dict[int, list[tuple[int, Value]]] = {}  # id(layer) -> parts
        self.filled: Counter[int] = Counter()  # id(parameter) -> rows copied in
        self.done: set[int] = set()
        self.kinds: Counter[str] = Counter()

    def put(self, target: nn.Module | torch.Tensor, lo: int, value: Value) -> None:
        if isinstance(target, torch.Tensor):  # norms and biases: small, always dense
            assert isinstance(value, torch.Tensor)
            target[lo : lo + value.shape[0]].copy_(value)
            self.filled[id(target)] += value.shape[0]
            if self.filled[id(target)] == target.shape[0]:
                self.done.add(id(target))
            return
        parts = self.staged.setdefault(id(target), [])
        parts.append((lo, value))
        if sum(_shape(v)[0] for _, v in parts) == _rows(target):
            del self.staged[id(target)]
            self._build(target, [v for _, v in sorted(parts, key=lambda p: p[0])])
            self.done.add(id(target))

    def _build(self, target: nn.Module, parts: list[Value]) -> None:
        head = target is self.model.lm_head
        if isinstance(target, Embedding):
            self._build_embedding(target, parts)
            if self.model.config.tie_word_embeddings:
                self._build_linear(self.model.lm_head, parts, head=True)
                self.done.add(id(self.model.lm_head))
            return
        assert isinstance(target, Linear)
        self._build_linear(target, parts, head)

    def _dense(self, parts: list[Value], dtype: torch.dtype) -> torch.Tensor:
        whole = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
        return torch.cat(whole).to(dtype=dtype, device=self.device)

    def _packed_rows(self, parts: list[Value], head: bool) -> QuantRows | None:
        """The quantized rows to pack, or None for dense storage."""
        if self.quantization == "gguf":
            if any(isinstance(p, torch.Tensor) for p in parts):
                return None
            return concat_rows([p for p in parts if not isinstance(p, torch.Tensor)])
        if self.quantization in ("int8", "int4"):
            w = self._dense(parts, torch.float32)
            if w.shape[1] % 32:
                return None
            return (
                quantize_int4(w) if self.quantization == "int4" and not head else quantize_int8(w)
            )
        return None

    def _build_linear(self, target: Linear, parts: list[Value], head: bool) -> None:
        rows = self._packed_rows(parts, head)
        if rows is not None:
            try:
                # The LM head keeps bfloat16 inputs where the layers take int8 ones.
                on_cpu = self.device.type == "cpu"
                kernel_name = int4_tiles.head_kernel() if head and on_cpu else None
                packed = packed_kernel(rows, kernel_dtype(self.dtype), self.device, kernel_name)
                if self.gemm_rows is not None:
                    # The head too: a decode step of 32 rows costs the packed int8 head
                    # ~3x the bfloat16 GEMM's time. By rows only (see ``ManyRows``).
                    self._add_gemm(packed, rows, by_phase=not head)
                kernel: LinearKernel = packed
                if head and kernel_dtype(self.dtype) != self.dtype:
                    kernel = RefinedHead(packed, rows)
                target.kernel = kernel
                self.kinds[target.kind] += 1
                return
            except QuantizationUnsupported as e:
                logger.info("a %s linear stays dense: %s", tuple(rows.codes.shape), e)
        target.kernel = DenseKernel(self._dense(parts, self.dtype))
        self.kinds[target.kind] += 1

    def _add_gemm(
        self, packed: Int4Kernel | Int8Kernel, rows: QuantRows, by_phase: bool = True
    ) -> None:
        # int8 inputs for the layers, not the LM head (``by_phase`` False): the logits, which
        # sampling and logprobs read, carry no rounding of their inputs beyond bfloat16
        # (the layers on int8: perplexity +0.39 %, benchmarks/results/perplexity.md).
        if self.gemm_inputs == "int8" and by_phase:
            gemm = tiles_gemm(packed, "int8")
        elif packed.kernel == "amx":
            gemm = tiles_gemm(packed)
        else:
            gemm = bf16_gemm(rows.dequantize(), self.shareable)
        key = (f"{type(packed).__name__}|{packed.kernel}|{type(gemm).__name__}", *packed.shape)
        packed.with_gemm(gemm, NEVER, by_phase)  # until set_crossovers
        self.with_gemm.setdefault(key, []).append(packed)

    def set_crossovers(self) -> None:
        """Each shape's row count from which its layers run the GEMM: ``gemm_rows``, else
        measured on all the model's layers of that shape in turn, as a step runs them.

        NOTE: not on one layer: one layer's weights stay in cache between repeats, which
        favours the GEMM (its bfloat16 weights are 4x the packed bytes); a step streams
        every layer's weights from memory, where the packed kernel's fewer bytes count.
        """
        for key, kernels in self.with_gemm.items():
            kinds, n, k = key
            if self.gemm_rows:
                rows = self.gemm_rows
            else:
                gemms = [kernel.many_rows.gemm for kernel in kernels if kernel.many_rows]

                def packed_pass(
                    x: torch.Tensor, ks: list[Int4Kernel | Int8Kernel] = kernels
                ) -> None:
                    for kernel in ks:
                        kernel.packed_forward(x, None)

                def gemm_pass(x: torch.Tensor, gs: list[nn.Module] = gemms) -> None:
                    for gemm in gs:
                        gemm(x)

                tag = f"{kinds}|x{len(kernels)}"
                rows = min_gemm_rows(packed_pass, gemm_pass, (n, k), tag)
            self.crossovers[key] = rows
            for kernel in kernels:
                assert kernel.many_rows is not None
                kernel.many_rows.min_rows = rows

    def _build_embedding(self, target: Embedding, parts: list[Value]) -> None:
        if self.quantization == "gguf" and not any(isinstance(p, torch.Tensor) for p in parts):
            rows = concat_rows([p for p in parts if not isinstance(p, torch.Tensor)])
            if rows is not None:
                target.set_quantized(rows)
                return
        if self.quantization in ("int8", "int4") and target.embedding_dim % 32 == 0:
            target.set_quantized(quantize_int8(self._dense(parts, torch.float32)))
            return
        target.set_dense(self._dense(parts, self.dtype))


@torch.no_grad()
def load_weights(
    model: CausalLM,
    root: Path,
    quantization: str = "none",
    gemm_rows: int | None = None,
    shareable: bool = False,
    gemm_inputs: str = "bfloat16",
) -> None:
    """Fill every layer of ``model``; unknown or missing tensors are errors.

    ``quantization``: a resolved one (``engine.weights.plan.resolve_quantization``).
    ``gemm_rows``: packed layers also hold a bfloat16 GEMM, at two bytes a weight, for calls
    of that many rows or more (``Int4Kernel.with_gemm``); 0: the crossover measured on this
    machine (``engine.weights.gemm.min_gemm_rows``); None: packed kernels alone.
    ``shareable``: that GEMM's weight an ordinary tensor (plain or VNNI-packed, what a
    shared image holds: ``engine/checkpoint/shared_weights.py``), never oneDNN's opaque
    prepacked one (``engine.weights.gemm.bf16_gemm``).
    ``gemm_inputs``: a resolved ``int4_tiles.gemm_inputs``; ``int8``: that GEMM is
    ``A8Gemm`` on the packed layers' own tiles, which holds no copy.
    """
    loader = _Loader(model, quantization, gemm_rows, shareable, gemm_inputs)
    values = _gguf_values(root) if quantization == "gguf" else iter_tensors(root)
    for name, value in values:
        if name.endswith(_IGNORED):
            continue
        target = _target(model, name)
        if target is None:
            if name == "lm_head.weight":
                continue  # tied checkpoints may still store a copy
            raise UnsupportedModelError(f"{root}: unexpected tensor {name!r} in checkpoint")
        layer, lo, hi = target
        hi = _rows(layer) if hi == -1 else hi
        shape, want = _shape(value), (hi - lo, *_width(layer))
        if shape != want:
            raise UnsupportedModelError(f"{name}: shape {shape} does not fit {want}")
        loader.put(layer, lo, value)
    layers = [("embed", model.embed), ("lm_head", model.lm_head)]
    layers += [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    params = list(model.named_parameters())
    missing = sorted({n for n, x in [*layers, *params] if id(x) not in loader.done})
    if missing:
        raise UnsupportedModelError(f"{root}: checkpoint lacks weights for {missing}")
    loader.set_crossovers()
    release_freed_memory()
    logger.info(
        "loaded %s (%s): %s",
        root.name,
        quantization,
        ", ".join(f"{n} {k}" for k, n in sorted(loader.kinds.items())),
    )
    for (kinds, n, k), rows in sorted(loader.crossovers.items()):
        from_rows = str(rows) if rows < NEVER else "no"
        logger.info("(%d, %d) %s: the GEMM from %s rows", n, k, kinds, from_rows)


def release_freed_memory() -> None:
    """Hand the load's freed buffers back to the OS. Packing goes through float and byte
    copies several times the packed size; glibc keeps freed heap for reuse, so without
    this a worker's resident memory stays ~150 MB above what it holds (SmolLM2, packed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)
