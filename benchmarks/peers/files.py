"""The files the head-to-head serves: each precision's GGUF, made where missing, and the
roofline of a one-stream token on each."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness.servers import ServerFailed
from benchmarks.peers import llama_cpp
from benchmarks.peers.contenders import LLAMA, PRECISIONS, Quant, Settings, shipped_q4_1


def gguf_files(
    args: argparse.Namespace,
    s: Settings,
    precisions: list[str],
    quants: list[Quant],
    failures: dict[str, str],
    setup: list[str],
) -> dict[str, Path]:
    """The GGUF of each precision some server needs, made if missing (where it would be,
    in a dry run).

    F32 and Q8_0 are made by llama.cpp's own converter from the checkpoint dir; Q4_1 is
    the file pdserve's default model ships (else ``llama-quantize`` of the F32 one). A
    failure is the llama.cpp peer's, unless a pdserve variant needs the file too.
    """
    need = set() if args.no_llama_cpp else set(precisions)
    need |= {q.gguf for q in quants if q.gguf and q.precision in precisions}
    outtype = {
        "F32": {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(s.dtype, "f32"),
        "Q8_0": "q8_0",
    }
    root, model = args.llama_dir, s.model
    out: dict[str, Path] = {}
    shipped = shipped_q4_1(model) if "Q4_1" in need else None
    if shipped is not None:
        out["Q4_1"] = shipped
    todo = sorted(need - set(out), key=PRECISIONS.index)
    try:
        for p in todo:
            if args.dry_run:
                tag = llama_cpp.OUTTYPES[outtype.get(p, "f32")]
                path = llama_cpp.gguf_path(root, model, tag)
                out[p] = (
                    path.with_name(path.name.replace(".F32.", ".Q4_1.")) if p == "Q4_1" else path
                )
                continue
            source = llama_cpp.ensure_source(root, args.llama_spec)
            if p == "Q4_1":
                build = llama_cpp.ensure_llama_cpp(root, args.llama_spec)
                f32 = llama_cpp.ensure_gguf(root, source, model, "f32")
                out[p] = llama_cpp.ensure_quantized(build, f32, "Q4_1")
            else:
                out[p] = llama_cpp.ensure_gguf(root, source, model, outtype[p])
    except ServerFailed as e:
        if any(q.gguf in todo for q in quants):
            raise
        failures[LLAMA] = f"making the GGUFs: {e}"
        setup.append(f"{LLAMA}: GGUFs could not be made")
        return out
    if out:
        made = "F32/Q8_0 made by llama.cpp's convert_hf_to_gguf.py from the checkpoint dir"
        ordered = sorted(out.items(), key=lambda item: PRECISIONS.index(item[0]))
        setup.append(
            "GGUFs: " + ", ".join(f"{p} `{path.name}`" for p, path in ordered) + f" ({made})"
        )
    return out


def roofline(argv: list[str]) -> list[str]:
    """A line per GGUF the servers' command lines ``argv`` name: its bytes over the copy
    rate measured now, the least time a one-stream decode step can take (every weight is
    read once a token; a tied head reads the whole embedding), to set the single-stream ITL
    against."""
    from benchmarks.engine.engine_step import copy_rate

    files = sorted({Path(arg) for arg in argv if arg.endswith(".gguf")})
    if not files:
        return []
    rate = copy_rate()
    return [
        f"roofline: `{f.name}` {f.stat().st_size / 1e6:.0f} MB / a copy rate of "
        f"{rate / 1e9:.1f} GB/s (read and written, measured at the start of the run) = "
        f"{f.stat().st_size / rate * 1e3:.2f} ms a token at one stream"
        for f in files
    ]
