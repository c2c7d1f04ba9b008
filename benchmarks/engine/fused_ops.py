"""The row-wise ops around the GEMMs, one implementation against another, per row count.

    python -m benchmarks.engine.fused_ops [--rows 1,8,32,256] [--dtypes float32,bfloat16] \
        [--threads 2] [--iters 200] [--no-compile]

For each op of one SmolLM2-135M layer (hidden 576, 9 query and 3 KV heads of 64,
intermediate 1536): add + RMSNorm, rotary over q and k (in place in the qkv projection),
rotary + K/V store (from the projection into a bfloat16 pool), SiLU * up, decode
attention, and (per ``--prompt-tokens``, bfloat16) one prompt's causal attention; up to
four implementations:

* ``torch``: the torch backend's eager ops (engine/model/backend.py), the reference;
* ``library``: the kernel library's op (engine/kernels/vllm_cpu.py); for rotary + store, its
  four steps as the fused backend ran them (widen, rotate, round, store);
* ``pdserve``: pdserve's own kernel (engine/kernels/cpu/), where it has one and
  it is built: ``rope_store``, ``silu_mul``, ``decode_attention``, ``prefill_attention``;
* ``compiled``: the torch ops under ``torch.compile`` (inductor, one graph per row count,
  its cache under the pdserve cache dir), when ``--no-compile`` is not given.

Each round calls every implementation once in turn (so load hits all alike); the median
microseconds per call are kept. Writes ``benchmarks/results/fused_ops.md``; the fused CPU
backend (engine/model/fused_cpu.py) takes, per op and dtype, what measures fastest here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.engine.attention_ops import (
    CONTEXT,
    EPS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    Op,
    decode_attention_ops,
    prefill_attention_ops,
    step_attention_ops,
    verify_attention_ops,
)
from benchmarks.harness.machine import load_average, machine_block
from engine.cache import cache_dir
from engine.kernels.cpu.ops import (
    rope_store_op,
    silu_mul_op,
)
from engine.kernels.vllm_cpu import available
from engine.model.fused_cpu import ISA
from engine.model.rope import apply_rotary

RESULTS = Path(__file__).parents[1] / "results" / "fused_ops.md"


def _norm_ops(rows: int, dtype: torch.dtype) -> dict[str, Op]:
    x, res, w = (
        torch.randn(rows, HIDDEN, dtype=dtype),
        torch.randn(rows, HIDDEN, dtype=dtype),
        torch.ones(HIDDEN, dtype=dtype),
    )

    def eager(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        s = res.add_(x)
        if s.dtype == torch.float32:
            return F.rms_norm(s, (HIDDEN,), w, EPS)
        s32 = s.float()
        return w * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS)).to(s.dtype)

    ops: dict[str, Op] = {"torch": lambda: eager(x, res)}
    ops["library"] = lambda: torch.ops._C.fused_add_rms_norm(x, res, w, EPS)
    ops.update(_compiled(eager, x, res))
    return ops


def _rotary_ops(rows: int, dtype: torch.dtype) -> dict[str, Op]:
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(rows, q_size + 2 * kv_size, dtype=dtype)
    pos = torch.randint(0, 1000, (rows,))
    freqs = torch.randn(2048, HEAD_DIM // 2)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=1).to(dtype)
    cos_t, sin_t = (
        cos_sin[:, : HEAD_DIM // 2].repeat(1, 2),
        cos_sin[:, HEAD_DIM // 2 :].repeat(1, 2),
    )

    def eager(qkv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
        return apply_rotary(qkv[:, : q_size + kv_size].unflatten(1, (-1, HEAD_DIM)), cos, sin)

    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    ops: dict[str, Op] = {"torch": lambda: eager(qkv, pos)}
    ops["library"] = lambda: torch.ops._C.rotary_embedding(pos, q, k, HEAD_DIM, cos_sin, True)
    ops.update(_compiled(eager, qkv, pos))
    return ops


def _rope_store_ops(rows: int, dtype: torch.dtype) -> dict[str, Op]:
    """Rotary over q and k of a (rows, q | k | v) projection in ``dtype``, then K and V into
    their slots of a bfloat16 pool (rows sequences' next token each, 300 tokens in)."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    bs, blocks = 16, -(-(CONTEXT + 1) // 16)
    qkv = torch.randn(rows, q_size + 2 * kv_size).to(dtype)
    pos = torch.full((rows,), CONTEXT)
    slots = torch.arange(rows) * blocks * bs + CONTEXT  # one sequence's blocks after another
    key_cache = torch.zeros(rows * blocks, KV_HEADS, bs, HEAD_DIM, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    flat = torch.zeros(rows * blocks * bs, 2, kv_size, dtype=torch.bfloat16)  # torch's rows
    freqs = torch.randn(2048, HEAD_DIM // 2)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=1)  # float32: the model's tables
    cos_t, sin_t = (
        cos_sin[:, : HEAD_DIM // 2].repeat(1, 2),
        cos_sin[:, HEAD_DIM // 2 :].repeat(1, 2),
    )

    def eager() -> torch.Tensor:
        cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
        x = qkv.float()
        qk = apply_rotary(x[:, : q_size + kv_size].unflatten(1, (-1, HEAD_DIM)), cos, sin)
        flat[slots, 0] = qk[:, HEADS:].flatten(1).to(torch.bfloat16)
        flat[slots, 1] = x[:, q_size + kv_size :].to(torch.bfloat16)
        return qk[:, :HEADS].to(torch.bfloat16)

    def library() -> torch.Tensor:
        x = qkv.float()
        torch.ops._C.rotary_embedding(
            pos, x[:, :q_size], x[:, q_size : q_size + kv_size], HEAD_DIM, cos_sin, True
        )
        x = x.to(torch.bfloat16)
        torch.ops._C.cpu_attn_reshape_and_cache(
            x[:, q_size : q_size + kv_size].view(rows, KV_HEADS, HEAD_DIM),
            x[:, q_size + kv_size :].view(rows, KV_HEADS, HEAD_DIM),
            key_cache,
            value_cache,
            slots,
            ISA,
        )
        return x[:, :q_size]

    ops: dict[str, Op] = {"torch": eager, "library": library}
    if (rope_store := rope_store_op()) is not None:
        ops["pdserve"] = lambda: rope_store(
            qkv, pos, cos_sin, key_cache, value_cache, slots, HEADS, KV_HEADS
        )
    return ops


def _silu_ops(rows: int, dtype: torch.dtype) -> dict[str, Op]:
    gate_up = torch.randn(rows, 2 * INTER, dtype=dtype)

    def eager(gate_up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate_up[:, :INTER]).mul_(gate_up[:, INTER:])

    def library() -> torch.Tensor:
        out = torch.empty(rows, INTER, dtype=dtype)
        torch.ops._C.silu_and_mul(out, gate_up)
        return out

    ops: dict[str, Op] = {"torch": lambda: eager(gate_up), "library": library}
    ops.update(_compiled(eager, gate_up))
    if (silu_mul := silu_mul_op()) is not None:
        ops["pdserve"] = lambda: silu_mul(gate_up, dtype)
    return ops


COMPILE = True


def _compiled(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> dict[str, Op]:
    if not COMPILE:
        return {}
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    return {"compiled": lambda: compiled(*args)}


def _time(ops: dict[str, Op], iters: int) -> dict[str, float]:
    """Median microseconds per call of each op, the ops taking turns."""
    with torch.inference_mode():
        for op in ops.values():  # warm-up (and compilation)
            for _ in range(3):
                op()
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(iters):
            for name, op in ops.items():
                t0 = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def main() -> None:
    global COMPILE
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.fused_ops", description=__doc__)
    p.add_argument("--rows", default="1,8,32,256")
    p.add_argument("--prompt-tokens", default="256,1024,2048", help="prefill attention's")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--verify-drafts", default="1,2,4,8", help="verification attention's")
    p.add_argument("--verify-context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    COMPILE = not args.no_compile
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir("inductor")))
    torch.set_num_threads(args.threads)
    kernels = available()
    if kernels is None:
        raise SystemExit("the kernel library does not load here (see the log)")
    lines = [
        "# Row-wise ops: torch eager, the kernel library, pdserve's kernels, torch.compile",
        "",
        f"Library build `{kernels.path.name}` ({kernels.isa}), {args.threads} threads, median "
        f"of {args.iters} interleaved calls, microseconds per call (`-`: no such "
        "implementation). Command: "
        f"`{shlex.join(['python', '-m', 'benchmarks.engine.fused_ops', *sys.argv[1:]])}`",
        "",
        "| op | dtype | rows | torch | library | pdserve | compiled | library / torch "
        "| pdserve / torch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in (int(r) for r in args.rows.split(",")):
            for op_name, make in (
                ("add + rmsnorm", _norm_ops),
                ("rotary q, k", _rotary_ops),
                ("rotary + K/V store", _rope_store_ops),
                ("silu * up", _silu_ops),
                (f"decode attention, {CONTEXT} ctx", decode_attention_ops),
                (
                    f"decode step's attention, {LAYERS} layers, scattered blocks",
                    step_attention_ops,
                ),
            ):
                if make in (decode_attention_ops, step_attention_ops) and dtype != torch.bfloat16:
                    continue  # the cache's dtype when serving
                t = _time(make(rows, dtype), args.iters if make is not step_attention_ops else 20)
                cells = [f"{t[k]:.1f}" if k in t else "-" for k in ("pdserve", "compiled")]
                base = t.get("torch", t["library"])  # the step's row: against the library
                ratio = f"{t['pdserve'] / base:.2f}" if "pdserve" in t else "-"
                torch_cell = f"{t['torch']:.1f}" if "torch" in t else "-"
                line = (
                    f"| {op_name} | {dtype_name} | {rows} | {torch_cell} | {t['library']:.1f} "
                    f"| {' | '.join(cells)} | {t['library'] / base:.2f} | {ratio} |"
                )
                print(line, flush=True)
                lines.append(line)
    for tokens in (int(n) for n in args.prompt_tokens.split(",")):
        t = _time(prefill_attention_ops(tokens, torch.bfloat16), max(10, args.iters // 10))
        ours, ratio = ("-", "-")
        if "pdserve" in t:
            ours, ratio = f"{t['pdserve']:.1f}", f"{t['pdserve'] / t['torch']:.2f}"
        line = (
            f"| prefill attention, one prompt, causal | bfloat16 | {tokens} | {t['torch']:.1f} "
            f"| {t['library']:.1f} | {ours} | - | {t['library'] / t['torch']:.2f} | {ratio} |"
        )
        print(line, flush=True)
        lines.append(line)
    lines += [
        "",
        f"A speculative verification's attention ({LAYERS} layers, drafts + 1 query rows of one "
        f"sequence, row j over {args.verify_context} + j tokens, scattered blocks, bfloat16), "
        "microseconds:",
        "",
        "| drafts | library, rows as requests | pdserve, rows apart | pdserve, rows together "
        "| together / apart | together / library |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for drafts in (int(n) for n in args.verify_drafts.split(",")):
        t = _time(verify_attention_ops(drafts, args.verify_context), 20)
        if "together" not in t:
            line = f"| {drafts} | {t['library']:.1f} | - | - | - | - |"
        else:
            line = (
                f"| {drafts} | {t['library']:.1f} | {t['apart']:.1f} | {t['together']:.1f} "
                f"| {t['together'] / t['apart']:.2f} | {t['together'] / t['library']:.2f} |"
            )
        print(line, flush=True)
        lines.append(line)
    lines += ["", f"Load average at the end: {load_average()}.", "", *machine_block()]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
