"""What int8 arithmetic in a prompt's GEMMs would buy in speed and cost in quality, by scheme.

    python -m benchmarks.engine.int8_schemes [--model DIR|FILE.gguf] [--rows 256,2048] \
        [--threads 2] [--iters 5] [--window 512] [--out FILE]

A prompt's forward is bound by the bfloat16 GEMM (``engine/weights/gemm.py``), the kernel
library's, near this CPU's pair-dot peak. VNNI multiplies bytes at twice the rate of
bfloat16 pair-dots, so int8 arithmetic is the lever left for TTFT on a CPU without AMX.
Schemes, each on every decoder layer's linear calls (the LM head stays as served):

* ``bf16``: the default: bfloat16 inputs times the weights rounded to bfloat16 (``VnniGemm``);
* ``a8``: int8 inputs per group of 32 times the int4 tiles (``A8Gemm``, ``launch
  --gemm-inputs int8``);
* ``w8a8``: int8 inputs per token times int8 weights per output channel, made from the
  bfloat16 weights: the kernel library's ``int8_scaled_mm_with_quant``;
* ``w8`` and ``a8-token``: the two halves of ``w8a8`` apart, each emulated in float32 on the
  bfloat16 weights (no kernel; quality only), to tell which half costs what;
* ``w8a8-smooth``: ``w8a8`` after moving part of each input channel's range into the
  weights (SmoothQuant's migration, alpha 0.5: x_j / s_j times W_j s_j, s_j =
  sqrt(max |x_j| / max |W_j|)), the maxima from a calibration text
  (``benchmarks/data/calibration.txt``, a frozen copy of ``docs/roles.md``, not the scored
  text); emulated in float32 (quality only).

Speed: each scheme's GEMMs of one forward's layers at ``--rows`` rows of random inputs,
the schemes taking turns, median of ``--iters``, as a ratio to ``bf16``. Quality:
teacher-forced perplexity (``benchmarks/engine/perplexity.py``, one prefill a window, every
call of the layers on the scheme) against the float32 reference (``--quantization none``).
Writes ``benchmarks/results/int8_schemes.md``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from benchmarks.engine.linear_kernels import Calls, interleaved_ms
from benchmarks.engine.perplexity import TEXT, engine_config, score, score_runner
from benchmarks.harness.machine import load_average, machine_block
from bundled_models.default_model import resolve_model
from engine.build import build_engine
from engine.kernels import vllm_cpu
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.tokenizer.hf_tokenizer import load_tokenizer
from engine.weights import int4_tiles
from engine.weights.linear import Int4Kernel, Int8Kernel, Linear
from wire.params import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "int8_schemes.md"
CALIBRATION = Path(__file__).parents[1] / "data" / "calibration.txt"
SCHEMES = ("bf16", "a8", "w8a8", "w8", "a8-token", "w8a8-smooth")
EMULATED = ("w8", "a8-token", "w8a8-smooth")


def int8_codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) float32 -> its int8 codes (R, C) as float32 and each row's step (R, 1),
    max |row| / 127."""
    step = t.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    return torch.round(t / step).clamp(-127, 127), step


def per_row_int8(t: torch.Tensor) -> torch.Tensor:
    """t (R, C) float32 rounded to int8 steps, one step a row (``int8_codes``)."""
    codes, step = int8_codes(t)
    return codes * step


class W8A8Gemm(nn.Module):
    """(N, K) weights as int8 per output channel; each call's rows as int8 per row (the
    library's dynamic quantization); bfloat16 out. x: (T, K) -> (T, N)."""

    compute_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        codes, step = int8_codes(weight.float())
        self.scale = step.view(-1)  # (N,)
        self.codes = torch.ops._C.convert_weight_packed(codes.to(torch.int8).contiguous())

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops._C.int8_scaled_mm_with_quant(
            xb, self.codes, self.scale, None, torch.bfloat16, True
        )
        return y.to(out_dtype or x.dtype)


class EmulatedGemm(nn.Module):
    """W8A8's parts in float32: ``w8`` rounds the weights per output channel, ``a8-token``
    each call's rows per row, ``w8a8-smooth`` both after moving part of each input
    channel's range into the weights. x: (T, K) -> (T, N)."""

    compute_dtype = torch.float32

    def __init__(
        self, weight: torch.Tensor, scheme: str, x_max: torch.Tensor | None = None
    ) -> None:
        """``x_max`` (K,): each input channel's largest magnitude on the calibration text,
        for ``w8a8-smooth``."""
        super().__init__()
        w = weight.float()
        self.smooth: torch.Tensor | None = None
        if scheme == "w8a8-smooth":
            assert x_max is not None
            self.smooth = (x_max.clamp_min(1e-5) / w.abs().amax(0).clamp_min(1e-5)).sqrt()
            w = w * self.smooth  # (N, K): channel j scaled by s_j, its inputs divided by it
        self.weight = per_row_int8(w) if scheme in ("w8", "w8a8-smooth") else w
        self.inputs_per_row = scheme in ("a8-token", "w8a8-smooth")

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xf = x.to(torch.bfloat16).float()  # the inputs every GEMM here takes
        if self.smooth is not None:
            xf = xf / self.smooth
        if self.inputs_per_row:
            xf = per_row_int8(xf)
        return (xf @ self.weight.T).to(out_dtype or x.dtype)


class InputMaxima(nn.Module):
    """A layer's GEMM that also keeps each input channel's largest magnitude seen."""

    def __init__(self, gemm: nn.Module, in_features: int) -> None:
        super().__init__()
        self.gemm, self.compute_dtype = gemm, gemm.compute_dtype
        self.x_max = torch.zeros(in_features)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        torch.maximum(self.x_max, x.float().abs().amax(0), out=self.x_max)
        return self.gemm.forward(x, out_dtype)


def calibrate(runner: ModelRunner, ids: list[int], window: int) -> list[torch.Tensor]:
    """Per layer kernel (``layer_kernels``' order), its input channels' maxima over ``ids``,
    one prefill a window, as a prompt's forward sees them."""
    kernels = layer_kernels(runner)
    probes: list[InputMaxima] = []
    for kernel in kernels:
        assert kernel.many_rows is not None
        probes.append(InputMaxima(kernel.many_rows.gemm, kernel.in_features))
        kernel.many_rows.gemm = probes[-1]
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        seq = Sequence(10**9 + start, chunk, sampling=SamplingParams())
        runner.prefill([(seq, len(chunk))])
        runner.kv.free_blocks(seq)
    for kernel, probe in zip(kernels, probes, strict=True):
        assert kernel.many_rows is not None
        kernel.many_rows.gemm = probe.gemm
    return [probe.x_max for probe in probes]


def layer_kernels(runner: ModelRunner) -> list[Int4Kernel | Int8Kernel]:
    """The packed kernels of the decoder layers' linear calls (not the LM head's), each with
    the GEMM it takes for many rows."""
    out = []
    for module in runner.model.modules():
        if not isinstance(module, Linear) or module is runner.model.lm_head:
            continue
        kernel = module.kernel
        if isinstance(kernel, Int4Kernel | Int8Kernel) and kernel.many_rows is not None:
            out.append(kernel)
    return out


def bf16_weight(kernel: Int4Kernel | Int8Kernel) -> torch.Tensor:
    """(N, K) float32: the weights the layer's bfloat16 GEMM multiplies (each exact in
    bfloat16), read back through that GEMM on the identity."""
    assert kernel.many_rows is not None
    gemm = kernel.many_rows.gemm
    eye = torch.eye(kernel.in_features, dtype=torch.bfloat16)
    return gemm.forward(eye, torch.float32).T.contiguous()


def available(scheme: str) -> bool:
    """Whether ``scheme`` runs here: ``a8`` on pdserve's int4 kernel with AVX-512 VNNI,
    ``w8a8`` where the kernel library's AVX-512 build is loaded."""
    if scheme == "a8":
        return int4_tiles.kernel_name() != "torch" and int4_tiles.a8_supported()
    if scheme == "w8a8":
        try:
            vllm_cpu.load()
        except vllm_cpu.CpuKernelsUnavailable:
            return False
        return hasattr(torch.ops._C, "int8_scaled_mm_with_quant")
    return True


def build(model: Path, scheme: str, window: int, quantization: str = "auto") -> ModelRunner:
    """The model as served (``quantization``: its weights' storage), every layer call on
    ``scheme``'s GEMM (from one row on)."""
    on = "a8" if scheme == "a8" else "gemm"  # perplexity's suffixes: every call on the GEMM
    runner = build_engine(engine_config(model, f"{quantization}+{on}", window)).runner
    if scheme in ("bf16", "a8"):
        return runner
    kernels = layer_kernels(runner)
    maxima: list[torch.Tensor | None] = [None] * len(kernels)
    if scheme == "w8a8-smooth":
        text = load_tokenizer(str(model))(CALIBRATION.read_text()).input_ids
        maxima = list(calibrate(runner, text, window))
    for kernel, x_max in zip(kernels, maxima, strict=True):
        assert kernel.many_rows is not None
        weight = bf16_weight(kernel)
        gemm = W8A8Gemm(weight) if scheme == "w8a8" else EmulatedGemm(weight, scheme, x_max)
        kernel.many_rows.gemm = gemm
    return runner


def time_schemes(runners: dict[str, ModelRunner], rows: int, iters: int) -> dict[str, float]:
    """ms for each scheme's layer GEMMs of one forward at ``rows`` rows, taking turns."""
    calls: dict[str, Calls] = {}
    for scheme, runner in runners.items():
        calls[scheme] = []
        for kernel in layer_kernels(runner):
            assert kernel.many_rows is not None
            calls[scheme].append((kernel.in_features, kernel.many_rows.gemm.forward))
    widths = {k for scheme_calls in calls.values() for k, _ in scheme_calls}
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in widths}
    return interleaved_ms(calls, xs, iters)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.int8_schemes", description=__doc__
    )
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--rows", default="256,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    schemes = [s for s in SCHEMES if available(s)]
    ids = load_tokenizer(str(model))(TEXT.read_text()).input_ids
    ref_nll, ref_argmax = score(model, "none", ids, args.window, False)
    quality: dict[str, tuple[float, float]] = {}
    runners: dict[str, ModelRunner] = {}
    for scheme in schemes:
        runner = build(model, scheme, args.window)
        nll, argmax = score_runner(runner, ids, args.window, False)
        agree = sum(a == b for a, b in zip(argmax, ref_argmax, strict=True)) / len(argmax)
        quality[scheme] = (math.exp(nll) / math.exp(ref_nll), agree)
        print(f"{scheme}: perplexity {quality[scheme][0]:.4f}x float32's, argmax {agree:.1%}")
        if scheme not in EMULATED:
            runners[scheme] = runner
    rows = [int(r) for r in args.rows.split(",")]
    speed = {m: time_schemes(runners, m, args.iters) for m in rows}
    for m in rows:
        print(m, {s: round(t, 2) for s, t in speed[m].items()})
    base = "bf16"
    lines = [
        "# int8 arithmetic in a prompt's GEMMs, by scheme",
        "",
        f"Command: `python -m benchmarks.engine.int8_schemes --rows {args.rows} "
        f"--threads {args.threads} --iters {args.iters}`"
        + (f" `--model {args.model.name}`" if args.model else "")
        + f". Model: `{model.name}`; {args.threads} threads; load average at the end: "
        f"{load_average()}.",
        "",
        "Time: the layers' GEMMs of one forward, median of the rounds, as a ratio to "
        f"`{base}` (ms in brackets). Perplexity: teacher-forced over "
        "`benchmarks/data/perplexity.txt`, one prefill a window, against float32's.",
        "",
        "| scheme | "
        + " | ".join(f"time, {m} rows" for m in rows)
        + " | perplexity vs float32 | argmax = float32's |",
        "|---|" + "---:|" * (len(rows) + 2),
    ]
    for scheme in schemes:
        times = [
            f"{speed[m][scheme] / speed[m][base]:.2f}x ({speed[m][scheme]:.1f})"
            if scheme in runners
            else "emulated"
            for m in rows
        ]
        ratio, agree = quality[scheme]
        lines.append(f"| {scheme} | " + " | ".join(times) + f" | {ratio:.4f}x | {agree:.1%} |")
    lines += ["", *machine_block()]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
