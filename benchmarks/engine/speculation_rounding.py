"""How far a speculative verification's logits sit from a decode step's, next to how far
batching alone moves a decode step's: the measure behind what docs/speculative.md promises of
speculation's outputs per device and dtype.

A verification runs a sequence's newest token and its drafts as k + 1 rows; its row 0
predicts what a decode step would. Where those rows get the decode step's bits, speculation
keeps outputs identical; where the verification runs other kernels than the decode step
(on CUDA: torch attention and GEMMs of k + 1 rows a sequence, against the Triton kernels
in a graph), a low-precision dtype can round them apart.

    python -m benchmarks.engine.speculation_rounding [--device cuda] [--drafts 4]

Prints one table (tiny Qwen2 checkpoint, 8 sequences of 5-117 prompt tokens); writes
nothing.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness.machine import machine_block
from bundled_models import tiny
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner

LENGTHS = [5, 17, 33, 64, 100, 117, 9, 48]
NEXT = 500  # every sequence's newest token


def _seqs() -> list[Sequence]:
    return [
        Sequence(i, [(7 * i + 13 * j) % 5000 + 100 for j in range(n)])
        for i, n in enumerate(LENGTHS)
    ]


def _runner(device: str, dtype: str) -> ModelRunner:
    model = str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH))
    return build_engine(
        EngineConfig(model=model, device=device, dtype=dtype, num_kv_blocks=512)
    ).runner


def _prefilled(runner: ModelRunner, seqs: list[Sequence]) -> list[Sequence]:
    runner.prefill([(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.output_ids.append(NEXT)
    return seqs


def measure(device: str, dtype: str, drafts: int) -> dict[str, float]:
    runner = _runner(device, dtype)
    batch = runner.decode(_prefilled(runner, _seqs())).float().cpu()  # (8, V)
    alone = torch.cat([runner.decode(_prefilled(runner, [s])).float().cpu() for s in _seqs()])
    seqs = _prefilled(runner, _seqs())
    rows = runner.verify(seqs, [[NEXT + 1 + j for j in range(drafts)]] * len(seqs))
    verify = rows.float().cpu()[:: drafts + 1]  # row 0 of each sequence
    top2 = batch.topk(2, dim=-1).values
    return {
        "batch vs alone": (batch - alone).abs().max().item(),
        "verify vs batch": (verify - batch).abs().max().item(),
        "verify vs alone": (verify - alone).abs().max().item(),
        "top-1 flips, batch vs alone": float((batch.argmax(-1) != alone.argmax(-1)).sum()),
        "top-1 flips, verify vs batch": float((verify.argmax(-1) != batch.argmax(-1)).sum()),
        "median top-1 gap": (top2[:, 0] - top2[:, 1]).median().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--drafts", type=int, default=4)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    print("\n".join(machine_block()))
    results = {d: measure(args.device, d, args.drafts) for d in ("float32", "bfloat16")}
    names = list(results["float32"])
    print(
        f"\n{args.device}, {args.drafts} drafts a sequence, 8 sequences, max |logit difference|:\n"
    )
    print("| measure | float32 | bfloat16 |\n| --- | ---: | ---: |")
    for n in names:
        print(f"| {n} | {results['float32'][n]:.3g} | {results['bfloat16'][n]:.3g} |")


if __name__ == "__main__":
    main()
