"""A loaded model's read-only weights as named tensors plus a small description, and back.

``export`` walks a ``CausalLM`` filled by the loader and returns what its kernels hold
(``engine/weights/linear.py``): per linear layer the kernel kind with its tensors (dense
weight; packed int4 codes and scales; int8's two nibble planes; the many-rows GEMM's
bfloat16 weight, plain or VNNI-packed, and its crossover; the refined LM head's quantized
rows), the embedding, and every parameter (norms, biases). ``bind`` gives a freshly built
``CausalLM`` of the same config the kernels those tensors describe, without reading or
packing anything: the tensors may be views of a shared mapping
(``engine/checkpoint/shared_weights.py``), and no kernel here ever writes its weights.

Tensor names are ``<module path>.<role>`` (``layers.3.mlp.down.packed``), and
``param:<name>`` for parameters. A tensor held twice (a tied embedding and LM head share
their quantized rows) is exported once per name; the writer stores equal storage once.

``LAYOUT_VERSION`` names this description together with the packed kernels' byte layouts:
bump it when either changes, so a stale image is never bound.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model.causal_lm import CausalLM
from engine.weights.gemm import PlainGemm, VnniGemm, vnni_supported
from engine.weights.int4_tiles import A8Gemm, TilesGemm
from engine.weights.linear import (
    DenseKernel,
    Embedding,
    Int4Kernel,
    Int8Kernel,
    Linear,
    LinearKernel,
    QuantizationUnsupported,
    tiles_gemm,
)
from engine.weights.quant import Int4Rows, Int8Rows, QuantRows
from engine.weights.refined_head import RefinedHead

LAYOUT_VERSION = 3
Meta = dict[str, Any]


class WeightsImageError(ValueError):
    """An image does not describe this model, or a kernel cannot be exported."""


def export(model: CausalLM) -> tuple[Meta, dict[str, torch.Tensor]]:
    """(description, name -> tensor) of everything ``model``'s weights are."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        tensors[f"param:{name}"] = p.detach()
    linears = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.kernel is not None, f"{name}: weights not loaded"
            linears[name] = _export_kernel(module.kernel, name, tensors)
    meta = {"linears": linears, "embed": _export_embedding(model.embed, tensors)}
    return meta, tensors


def bind(model: CausalLM, meta: Meta, tensors: dict[str, torch.Tensor]) -> None:
    """Give ``model`` (built, not loaded) the kernels ``meta`` describes over ``tensors``."""
    for name, p in model.named_parameters():
        t = _get(tensors, f"param:{name}", tuple(p.shape), p.dtype)
        p.data = t
    modules = dict(model.named_modules())
    linears = {n for n, m in modules.items() if isinstance(m, Linear)}
    if linears != set(meta["linears"]):
        missing = sorted(linears ^ set(meta["linears"]))[:4]
        raise WeightsImageError(f"the image's linear layers differ from the model's: {missing}")
    for name, km in meta["linears"].items():
        linear = modules[name]
        assert isinstance(linear, Linear)
        linear.kernel = _bind_kernel(km, name, tensors)
    _bind_embedding(model.embed, meta["embed"], tensors)


def _put(tensors: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> str:
    if t.layout != torch.strided or t.device.type != "cpu":
        raise WeightsImageError(f"{name}: a {t.layout} tensor on {t.device} has no bytes to share")
    tensors[name] = t.contiguous()
    return name


def _get(
    tensors: dict[str, torch.Tensor],
    name: str,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise WeightsImageError(f"the image lacks {name}")
    if (shape is not None and tuple(t.shape) != shape) or (dtype is not None and t.dtype != dtype):
        raise WeightsImageError(f"{name}: {t.dtype} {tuple(t.shape)}, want {dtype} {shape}")
    return t


def _export_rows(rows: QuantRows, prefix: str, tensors: dict[str, torch.Tensor]) -> Meta:
    _put(tensors, f"{prefix}.codes", rows.codes)
    _put(tensors, f"{prefix}.scale", rows.scale)
    if isinstance(rows, Int4Rows):
        _put(tensors, f"{prefix}.zero", rows.zero)
        return {"kind": "int4"}
    return {"kind": "int8"}


def _bind_rows(meta: Meta, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantRows:
    codes, scale = _get(tensors, f"{prefix}.codes"), _get(tensors, f"{prefix}.scale")
    if meta["kind"] == "int4":
        return Int4Rows(codes, scale, _get(tensors, f"{prefix}.zero"))
    return Int8Rows(codes, scale)


def _export_kernel(kernel: nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> Meta:
    if isinstance(kernel, DenseKernel):
        _put(tensors, f"{name}.weight", kernel.weight)
        return {"kind": "dense"}
    if isinstance(kernel, RefinedHead):
        return {
            "kind": "refined",
            "packed": _export_kernel(kernel.packed, f"{name}.packed", tensors),
            "rows": _export_rows(kernel.rows, f"{name}.rows", tensors),
        }
    if isinstance(kernel, Int4Kernel):
        for role, t in kernel.layout().items():
            _put(tensors, f"{name}.{role}", t)
        meta: Meta = {"kind": "int4", "shape": list(kernel.shape), "kernel": kernel.kernel}
    elif isinstance(kernel, Int8Kernel):
        meta = {
            "kind": "int8",
            "shape": list(kernel.shape),
            "planes": _export_kernel(kernel.planes, f"{name}.planes", tensors),
        }
    else:
        raise WeightsImageError(f"{name}: no image layout for a {type(kernel).__name__}")
    if kernel.many_rows is not None:
        gemm = kernel.many_rows.gemm
        meta["gemm_min_rows"] = kernel.many_rows.min_rows
        meta["gemm_by_phase"] = kernel.many_rows.by_phase
        if isinstance(gemm, TilesGemm):  # on the kernel's own tiles: nothing more to hold
            meta["gemm_layout"] = "a8" if isinstance(gemm, A8Gemm) else "tiles"
        elif isinstance(gemm, (PlainGemm, VnniGemm)):
            _put(tensors, f"{name}.gemm", gemm.weight)
            meta["gemm_layout"] = "vnni" if isinstance(gemm, VnniGemm) else "plain"
        else:
            # A oneDNN prepacked weight is an opaque per-process tensor: not shareable.
            raise WeightsImageError(f"{name}: a {type(gemm).__name__} cannot be shared")
    return meta


def _bind_kernel(meta: Meta, name: str, tensors: dict[str, torch.Tensor]) -> LinearKernel:
    kind = meta["kind"]
    if kind == "dense":
        return DenseKernel(_get(tensors, f"{name}.weight"))
    if kind == "refined":
        inner = _bind_kernel(meta["packed"], f"{name}.packed", tensors)
        return RefinedHead(inner, _bind_rows(meta["rows"], f"{name}.rows", tensors))
    shape = (int(meta["shape"][0]), int(meta["shape"][1]))
    kernel: Int4Kernel | Int8Kernel
    if kind == "int4":
        roles = Int4Kernel.roles(meta["kernel"])
        layout = {role: _get(tensors, f"{name}.{role}") for role in roles}
        try:
            kernel = Int4Kernel.from_packed(meta["kernel"], shape, **layout)
        except QuantizationUnsupported as e:
            raise WeightsImageError(f"{name}: {e}") from e
    elif kind == "int8":
        planes = _bind_kernel(meta["planes"], f"{name}.planes", tensors)
        assert isinstance(planes, Int4Kernel)
        kernel = Int8Kernel.from_planes(planes, shape)
    else:
        raise WeightsImageError(f"{name}: unknown kernel kind {kind!r}")
    if "gemm_min_rows" in meta:
        by_phase = bool(meta.get("gemm_by_phase", True))
        gemm: nn.Module
        if meta.get("gemm_layout") in ("tiles", "a8"):
            inputs = "int8" if meta["gemm_layout"] == "a8" else "bfloat16"
            kernel.with_gemm(tiles_gemm(kernel, inputs), int(meta["gemm_min_rows"]), by_phase)
            return kernel
        weight = _get(tensors, f"{name}.gemm", shape, torch.bfloat16)
        if meta.get("gemm_layout", "plain") == "plain":
            gemm = PlainGemm(weight)
        elif vnni_supported():
            gemm = VnniGemm.from_packed(weight)
        else:
            raise WeightsImageError(f"{name}: its GEMM weight is VNNI-packed, no kernel here")
        kernel.with_gemm(gemm, int(meta["gemm_min_rows"]), by_phase)
    return kernel


def _export_embedding(embed: Embedding, tensors: dict[str, torch.Tensor]) -> Meta:
    if embed.weight is not None:
        _put(tensors, "embed.weight", embed.weight)
        return {"kind": "dense"}
    assert embed.quant is not None, "weights not loaded"
    return {"kind": "quantized", "rows": _export_rows(embed.quant, "embed.rows", tensors)}


def _bind_embedding(embed: Embedding, meta: Meta, tensors: dict[str, torch.Tensor]) -> None:
    if meta["kind"] == "dense":
        shape = (embed.num_embeddings, embed.embedding_dim)
        embed.set_dense(_get(tensors, "embed.weight", shape))
    else:
        embed.set_quantized(_bind_rows(meta["rows"], "embed.rows", tensors))
