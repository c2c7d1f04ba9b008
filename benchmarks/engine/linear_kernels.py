"""The linear layers of one SmolLM2-135M step on each CPU kernel the engine can run, by rows.

    python -m benchmarks.engine.linear_kernels [--rows 1,8,16,32,256] [--threads 2] [--iters 10]

Per step: 30 layers of qkv (576 -> 960), o (576 -> 576), gate_up (576 -> 3072) and down
(1536 -> 576), random weights quantized to int4 in groups of 32 (as Q4_1); every kernel
holds the same de-quantized weights. Kernels: the packed int4 kernel (``Int4Kernel``) on
each int4 kernel this CPU runs (``engine/weights/int4_tiles.py``: pdserve's on AMX tiles,
on AVX-512 VNNI with int8 inputs or on AVX-512 BF16 pair-dots, torch's
``_weight_int4pack_mm_for_cpu``), the bfloat16 GEMM on a plain weight (``PlainGemm``, the torch-only path), prepacked for oneDNN
(``PrepackedGemm``, where this CPU's oneDNN computes bfloat16), VNNI-packed for the kernel
library's GEMM (``VnniGemm``, where its AVX-512 BF16 build loads), and on AMX the GEMM that
de-quantizes the int4 tiles once per call (``TilesGemm``), all fed bfloat16 rows; and where
AVX-512 VNNI runs, the same tiles with each row's inputs quantized to int8 (``A8Gemm``,
``--gemm-inputs int8``: not the same numbers, see its docstring).
Median of ``--iters`` steps after a warm-up, kernels interleaved row count by row count.
Writes ``benchmarks/results/linear_kernels.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.machine import load_average
from engine.weights import int4_tiles
from engine.weights.gemm import (
    PlainGemm,
    PrepackedGemm,
    VnniGemm,
    prepacked_supported,
    vnni_supported,
)
from engine.weights.linear import Int4Kernel, tiles_gemm
from engine.weights.quant import quantize_int4

RESULTS = Path(__file__).parents[1] / "results" / "linear_kernels.md"
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per layer
LAYERS = 30
Calls = list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]  # (in_features, kernel)


def _kernels() -> dict[str, Calls]:
    """name -> the step's 120 (in_features, kernel) calls."""
    gen = torch.Generator().manual_seed(0)
    int4 = int4_tiles.available_kernels()
    out: dict[str, Calls] = {f"packed int4 ({name})": [] for name in int4}
    out["bf16 GEMM, plain weight"] = []
    if prepacked_supported():
        out["bf16 GEMM, prepacked (oneDNN)"] = []
    if vnni_supported():
        out["bf16 GEMM, VNNI-packed (library)"] = []
    if "amx" in int4:
        out["bf16 GEMM on the int4 tiles (AMX)"] = []
    a8 = "avx512_bf16" in int4 and int4_tiles.a8_supported()
    if a8:
        out["int8 inputs x the int4 tiles (VNNI)"] = []
    for _ in range(LAYERS):
        for k, n in SHAPES:
            rows = quantize_int4(torch.randn(n, k, generator=gen) * 0.05)
            w = rows.dequantize()
            for name in int4:
                with _int4_kernel(name):
                    packed = Int4Kernel(rows, torch.bfloat16, torch.device("cpu"))
                out[f"packed int4 ({name})"].append((k, _packed(packed)))
            out["bf16 GEMM, plain weight"].append((k, PlainGemm(w)))
            if prepacked_supported():
                out["bf16 GEMM, prepacked (oneDNN)"].append((k, PrepackedGemm(w)))
            if vnni_supported():
                out["bf16 GEMM, VNNI-packed (library)"].append((k, VnniGemm(w)))
            if "amx" in int4:
                with _int4_kernel("amx"):
                    tiles = tiles_gemm(Int4Kernel(rows, torch.bfloat16, torch.device("cpu")))
                out["bf16 GEMM on the int4 tiles (AMX)"].append((k, tiles))
            if a8:
                with _int4_kernel("avx512_bf16"):
                    a8_gemm = tiles_gemm(
                        Int4Kernel(rows, torch.bfloat16, torch.device("cpu")), "int8"
                    )
                out["int8 inputs x the int4 tiles (VNNI)"].append((k, a8_gemm))
    return out


@contextmanager
def _int4_kernel(name: str) -> Iterator[None]:
    before = os.environ.get("PDSERVE_INT4_KERNEL")
    os.environ["PDSERVE_INT4_KERNEL"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["PDSERVE_INT4_KERNEL"]
        else:
            os.environ["PDSERVE_INT4_KERNEL"] = before


def _packed(kernel: Int4Kernel) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return kernel.packed_forward(x, None)

    return run


def interleaved_ms(
    kernels: dict[str, Calls], xs: dict[int, torch.Tensor], iters: int
) -> dict[str, float]:
    """Each kernel's calls in turn, round by round (the first round warms up), on ``xs``'s
    input of each width -> name: the median of its rounds in ms. Taking turns within a round
    lets the machine's drift hit every kernel alike."""
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    with torch.inference_mode():
        for it in range(iters + 1):
            for name, calls in kernels.items():
                t0 = time.perf_counter()
                for k, fn in calls:
                    fn(xs[k])
                if it:
                    samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.linear_kernels", description=__doc__
    )
    p.add_argument("--rows", default="1,8,16,32,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = _kernels()
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[str, dict[int, float]] = {name: {} for name in kernels}
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k, _ in SHAPES}
        for name, ms in interleaved_ms(kernels, xs, args.iters).items():
            times[name][m] = ms
            print(f"{name} rows {m}: {ms:.2f} ms", flush=True)
    load = load_average()
    lines = [
        "# The linear layers of one SmolLM2-135M step, by kernel and rows",
        "",
        f"30 layers x (qkv, o, gate_up, down), int4 groups of 32, bf16 rows, {args.threads} "
        f"threads, median of {args.iters}. Load average at the end: {load}. Command: "
        f"`python -m benchmarks.engine.linear_kernels --rows {args.rows} --threads {args.threads}`",
        "",
        "| kernel | " + " | ".join(f"{m} rows" for m in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for name, by_rows in times.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_rows[m]:.2f}" for m in rows) + " |")
    lines += ["", "ms per step. Machine:", "", "```", describe_machine(), "```", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
