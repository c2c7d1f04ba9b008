"""The decode step and a prefill step against the bare math of their layers, in one run.

    python -m benchmarks.engine.engine_step [--model DIR|FILE.gguf] [--variants auto,packed,none] \
        [--batches 1,8,32] [--context 300] [--prefill 256] [--threads 2] [--rounds 30]

Variants: ``auto`` a private engine (packed GGUF layers with the fastest bfloat16 GEMM this
CPU runs, for prefill and for decode batches from the crossover measured at load);
``shared`` serves as ``launch`` does on CPU (the same, its weights in a shared segment and
its GEMM on a shareable weight, ``engine/checkpoint/shared_weights.py``); ``packed`` the
same weights on the packed kernel alone (the engine before the GEMM copies, as a baseline
in the same run); ``none`` dense float32. A variant may name an activation dtype after
``@`` (``shared@bfloat16``: the residual stream, norms and rotary in bfloat16 too, as
``launch --dtype bfloat16`` serves; default: the model's, float32 on CPU), and then an int4
kernel after ``%`` (``shared%torch``: torch's, ``engine/weights/int4_tiles.py``; default:
the fastest this CPU runs).

"Step": ``ModelRunner.decode`` on a batch of ``B`` sequences with ``--context`` tokens of KV
each (metadata, embedding, 30 layers, head; no sampling). "Bare math": the same model's
own linear layers (the very kernels the step uses, packed or dense) and one decode SDPA
call per layer over a (B, KV heads, context, head dim) cache, on random inputs of the step's
shapes, with nothing around them. Both are timed interleaved, round by round, and each
side's median is kept, so load on a shared machine hits both alike. The ratio step / bare
is the overhead around the math (target <= 1.15x). A prefill step of ``--prefill`` tokens
is set against its linear layers alone on the same rows (target <= 1.2x). Writes
``benchmarks/results/engine_step.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness.machine import load_average, machine_block
from bundled_models.default_model import resolve_model
from engine.build import build_engine
from engine.checkpoint.weights_segment import create_segment
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.model.attention import grouped_decode_sdpa
from engine.model.causal_lm import DecoderLayer
from engine.model.fused_cpu import FusedCpuBackend
from engine.runner import ModelRunner
from engine.weights.linear import (
    DenseKernel,
    Int4Kernel,
    Int8Kernel,
    Linear,
    ManyRows,
    prefill_phase,
)
from engine.weights.refined_head import RefinedHead
from wire.params import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "engine_step.md"
# --backends names -> EngineConfig.attention_backend (on CPU, auto is the fused backend
# where its kernel library loads). ``fused-loop``: the fused backend with its decode steps'
# layers one by one from Python, not in one call (``FusedCpuBackend.decode_layers``).
BACKENDS = {"fused": "auto", "fused-loop": "auto", "torch": "torch"}


def _bare(runner: ModelRunner, b: int, context: int) -> object:
    """A closure running the step's math alone: every linear layer and one SDPA per layer."""
    m = runner.model_config
    model = runner.model
    dtype = runner.dtype
    x = torch.randn(b, m.hidden_size, dtype=dtype)
    layers = [model.layer(i) for i in range(m.num_layers)]
    inter = torch.randn(b, m.intermediate_size, dtype=dtype)
    attn_out = torch.randn(b, m.num_heads * m.head_dim, dtype=_attention_dtype(runner))
    q = torch.randn(b, m.num_heads, m.head_dim, dtype=dtype)
    kv = torch.randn(2, b, m.num_kv_heads, context, m.head_dim, dtype=dtype)
    bias = torch.zeros(b, 1, 1, context, dtype=dtype)

    def run() -> None:
        with torch.inference_mode():
            for layer in layers:
                _linears(
                    runner,
                    layer,
                    x,
                    attn_out,
                    inter,
                    lambda: grouped_decode_sdpa(q, kv[0], kv[1], bias),
                )
            model.lm_head(x)

    return run


def _attention_dtype(runner: ModelRunner) -> torch.dtype:
    """What the step's attention returns: the cache's dtype from the fused backend, the
    activations' from the torch one."""
    return runner.kv_dtype if runner.backend.takes_kernel_dtype else runner.dtype


def _linears(
    runner: ModelRunner,
    layer: DecoderLayer,
    x: torch.Tensor,
    attn_out: torch.Tensor,
    inter: torch.Tensor,
    attend: Callable[[], object],
) -> None:
    """One layer's four projections called as the step calls them (in and out dtypes
    included: ``CausalLM.hidden``), ``attend`` between the first two."""
    native = runner.backend.takes_kernel_dtype
    layer.attn.qkv.native(x) if native else layer.attn.qkv(x)
    attend()
    layer.attn.o(attn_out, x.dtype)
    layer.mlp.gate_up.native(x) if native else layer.mlp.gate_up(x)
    layer.mlp.down(inter, x.dtype)


def copy_rate(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes a second one plain copy of ``nbytes`` moves here, read and written counted (as
    STREAM's copy counts them), best of ``repeats``: the rate a step streaming its weights
    could reach at best."""
    src = torch.ones(nbytes // 8, dtype=torch.int64)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def step_bytes(runner: ModelRunner, b: int, context: int) -> int:
    """Bytes a decode step of ``b`` rows reads at least: every linear layer's weights as its
    few-rows kernel holds them (packed tiles, or the dense weight) and each row's KV."""
    total = 0
    for module in runner.model.modules():
        kernel: object = module.kernel if isinstance(module, Linear) else None
        if isinstance(kernel, RefinedHead):
            kernel = kernel.packed
        if isinstance(kernel, Int8Kernel):
            kernel = kernel.planes
        if isinstance(kernel, Int4Kernel):
            total += sum(t.nbytes for t in kernel.layout().values())
        elif isinstance(kernel, DenseKernel):
            total += kernel.weight.nbytes
    m = runner.model_config
    per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * runner.kv_dtype.itemsize
    return total + b * context * per_token


def measure_prefill(
    runners: dict[str, ModelRunner], tokens: int, rounds: int
) -> tuple[dict[str, float], float]:
    """(median prefill step ms per backend, median ms of its linear layers alone) for one
    prompt; the backends' steps and the GEMMs take turns within each round."""
    runner = next(iter(runners.values()))
    m, model = runner.model_config, runner.model
    layers = [model.layer(i) for i in range(m.num_layers)]
    x = torch.randn(tokens, m.hidden_size, dtype=runner.dtype)
    inter = torch.randn(tokens, m.intermediate_size, dtype=runner.dtype)
    attn_out = torch.randn(tokens, m.num_heads * m.head_dim, dtype=_attention_dtype(runner))

    def gemms() -> None:
        with torch.inference_mode(), prefill_phase():
            for layer in layers:
                _linears(runner, layer, x, attn_out, inter, lambda: None)
            model.lm_head(x[-1:])

    steps: dict[str, list[float]] = {name: [] for name in runners}
    bares = []
    for r in range(rounds // 3 + 2):
        for name, each in runners.items():
            seq = Sequence(
                r, [(5 * r + j) % 1000 + 10 for j in range(tokens)], sampling=SamplingParams()
            )
            t0 = time.perf_counter()
            each.prefill([(seq, tokens)])
            steps[name].append(time.perf_counter() - t0)
            each.kv.free_blocks(seq)
        t0 = time.perf_counter()
        gemms()
        bares.append(time.perf_counter() - t0)
    return {n: statistics.median(v[2:]) * 1e3 for n, v in steps.items()}, statistics.median(
        bares[2:]
    ) * 1e3


_LAYOUTS = {
    "VnniGemm": "VNNI-packed",
    "PrepackedGemm": "prepacked",
    "PlainGemm": "plain",
    "TilesGemm": "on the int4 tiles",
}


def _gemm_label(runner: ModelRunner, variant: str) -> str:
    """`` + bf16 GEMM (<layouts>[, shared])`` naming the GEMMs the runner's layers hold."""
    gemms = [getattr(m, "many_rows", None) for m in runner.model.modules()]
    names = {type(rows.gemm).__name__ for rows in gemms if isinstance(rows, ManyRows)}
    held = {_LAYOUTS.get(name, name) for name in names}
    if not held:
        return ""
    shared = variant.partition("%")[0].partition("@")[0] == "shared"
    return f" + bf16 GEMM ({'/'.join(sorted(held))}{', shared' if shared else ''})"


def _runner(model: Path, variant: str, backend: str, context: int) -> ModelRunner:
    variant, _, int4 = variant.partition("%")
    variant, _, dtype = variant.partition("@")
    quantization = "none" if variant == "none" else "auto"
    before = os.environ.get("PDSERVE_INT4_KERNEL")
    if int4:  # packed layers take the kernel named when they are built
        os.environ["PDSERVE_INT4_KERNEL"] = int4
    try:
        return _build(model, variant, dtype, quantization, backend, context)
    finally:
        os.environ.pop("PDSERVE_INT4_KERNEL", None)
        if before is not None:
            os.environ["PDSERVE_INT4_KERNEL"] = before


def _build(
    model: Path, variant: str, dtype: str, quantization: str, backend: str, context: int
) -> ModelRunner:
    runner = build_engine(
        EngineConfig(
            model=str(model),
            dtype=dtype or "auto",
            quantization=quantization,
            kv_cache_tokens=16 * (context + 64) * 32,
            large_batch_gemm=variant in ("auto", "shared"),
            # The launcher's default on CPU: the weights in a host segment, GEMMs plain.
            weights_fd=create_segment() if variant == "shared" else None,
            attention_backend=BACKENDS[backend],
        )
    ).runner
    if backend == "fused-loop" and isinstance(runner.backend, FusedCpuBackend):
        runner.backend.decode_layers_op = None
    return runner


def timed_decode(runner: ModelRunner, seqs: list[Sequence]) -> float:
    """Seconds of one decode step over ``seqs``; each is then given its next token."""
    t0 = time.perf_counter()
    runner.decode(seqs)
    took = time.perf_counter() - t0
    for s in seqs:
        s.output_ids.append(11)
    return took


def measure(
    runners: dict[str, ModelRunner], b: int, context: int, rounds: int
) -> tuple[dict[str, float], float]:
    """(median step ms per backend, median bare ms) at batch ``b``; each round runs every
    backend's step and the bare math once."""
    batches = {
        name: [
            Sequence(
                i, [(7 * i + j) % 1000 + 10 for j in range(context)], sampling=SamplingParams()
            )
            for i in range(b)
        ]
        for name in runners
    }
    for name, runner in runners.items():
        seqs = batches[name]
        runner.prefill([(s, s.num_tokens) for s in seqs])
        for s in seqs:
            s.output_ids.append(11)
    bare = _bare(next(iter(runners.values())), b, context)
    steps: dict[str, list[float]] = {name: [] for name in runners}
    bares = []
    for _ in range(rounds + 3):
        for name, runner in runners.items():
            steps[name].append(timed_decode(runner, batches[name]))
        t0 = time.perf_counter()
        bare()  # type: ignore[operator]
        bares.append(time.perf_counter() - t0)
    for name, runner in runners.items():
        for s in batches[name]:
            runner.kv.free_blocks(s)
    return {n: statistics.median(v[3:]) * 1e3 for n, v in steps.items()}, statistics.median(
        bares[3:]
    ) * 1e3


def step_arguments(p: argparse.ArgumentParser, out: Path) -> None:
    """The flags of a benchmark that times decode steps and a prefill of the default model."""
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", type=Path, default=out)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.engine_step", description=__doc__)
    p.add_argument("--variants", default="auto,packed,none")
    p.add_argument("--backends", default="fused,torch", help=f"some of {','.join(BACKENDS)}")
    step_arguments(p, RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    rate = copy_rate()
    rows: list[Row] = []
    for variant in args.variants.split(","):
        runners = {b: _runner(model, variant, b, args.context) for b in args.backends.split(",")}
        fused = [r for b, r in runners.items() if b.startswith("fused")]
        if not all(isinstance(r.backend, FusedCpuBackend) for r in fused):
            raise SystemExit("the fused backend did not load here (see the log): nothing to set")
        runner = next(iter(runners.values()))
        kind_names = sorted({m.kind for m in runner.model.modules() if isinstance(m, Linear)})
        kinds = "/".join(kind_names) + _gemm_label(runner, variant)
        for b in (int(x) for x in args.batches.split(",")):
            steps, bare = measure(runners, b, args.context, args.rounds)
            roof = step_bytes(runner, b, args.context) / rate * 1e3
            rows += [
                Row(variant, n, kinds, f"decode, batch {b}", t, bare, roof)
                for n, t in steps.items()
            ]
        steps, bare = measure_prefill(runners, args.prefill, args.rounds)
        what = f"prefill, {args.prefill} tokens"
        rows += [Row(variant, n, kinds, what, t, bare) for n, t in steps.items()]
        for row in rows[-len(runners) * (len(args.batches.split(",")) + 1) :]:
            print(row.line())
    given = [a if not a.startswith("/") else Path(a).name for a in sys.argv[1:]]
    cmd = " ".join(["python -m benchmarks.engine.engine_step", *given])
    args.out.write_text("\n".join(_page(rows, model.name, cmd, args, rate)))
    print(f"wrote {args.out}")


@dataclass(frozen=True)
class Row:
    variant: str
    backend: str
    kinds: str
    what: str
    step: float
    bare: float
    roofline: float | None = None  # ms: the step's bytes over the copy rate (decode rows)

    def line(self) -> str:
        roof = (
            "| |"
            if self.roofline is None
            else (f"| {self.roofline:.2f} | {self.step / self.roofline:.2f}x |")
        )
        return (
            f"| {self.variant} | {self.backend} | {self.kinds} | {self.what} | {self.step:.2f} "
            f"| {self.bare:.2f} | {self.step / self.bare:.2f}x {roof}"
        )


def _page(
    rows: list[Row], model: str, cmd: str, args: argparse.Namespace, rate: float
) -> list[str]:
    lines = [
        "# Decode and prefill steps vs the bare math of their layers",
        "",
        f"Model `{model}`, context {args.context} tokens, {args.threads} threads, "
        f"median of {args.rounds} interleaved rounds (prefill: {args.rounds // 3}). "
        f"Load average at the end: {load_average()}. Command: `{cmd}`",
        "",
        "Decode: the step against its linear layers and one SDPA per layer. Prefill: the step "
        "against its linear layers alone (the GEMMs). The bare math calls each linear as the "
        "first backend's step does, casts included (the fused one takes q, k, v and gate, up "
        "in the kernels' bfloat16). Backends (engine/model/backend.py): "
        "`fused`, the fused CPU ops (engine/model/fused_cpu.py), `fused-loop`, the same with "
        "a decode step's layers called one by one (not in one `decode_layers` call), and "
        "`torch`, the reference; each round runs every backend's step and the bare math once. "
        "Roofline (decode): the "
        "bytes a step reads at least (every linear layer's weights as its few-rows kernel "
        f"holds them, and the rows' KV) over the copy rate measured in the same run, "
        f"{rate / 1e9:.1f} GB/s (a 256 MB copy, read and written bytes counted, best of 5).",
        "",
        "| variant | backend | linear kinds | step | step ms | bare math ms | step / bare "
        "| roofline ms | step / roofline |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
        *(row.line() for row in rows),
    ]
    fused = {(r.variant, r.what): r.step for r in rows if r.backend == "fused"}
    by_torch = {(r.variant, r.what): r.step for r in rows if r.backend == "torch"}
    if fused and by_torch:
        lines += ["", "Torch / fused step time, same run (above 1: fused is faster):", ""]
        lines += [f"- {v}, {w}: {by_torch[v, w] / t:.2f}x" for (v, w), t in fused.items()]
    loop = {(r.variant, r.what): r.step for r in rows if r.backend == "fused-loop"}
    if fused and loop:
        lines += ["", "Layer loop / one call step time, same run (above 1: one call is faster):"]
        lines += [""] + [f"- {v}, {w}: {loop[v, w] / t:.2f}x" for (v, w), t in fused.items()]
    packed = {
        r.what: r.step for r in rows if r.variant == "packed" and r.backend == rows[0].backend
    }
    served = {r.what: r.step for r in rows if r.variant == "auto" and r.backend == rows[0].backend}
    if packed and served:
        lines += ["", "Packed alone / served step time, same run (above 1: served is faster):", ""]
        lines += [f"- {what}: {packed[what] / served[what]:.2f}x" for what in served]
    return [*lines, "", *machine_block()]


if __name__ == "__main__":
    main()
