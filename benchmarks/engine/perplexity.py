"""Teacher-forced perplexity of the served model under each weight storage.

    python -m benchmarks.engine.perplexity [--model DIR|FILE.gguf] [--window 512] [--threads N]

The text is ``benchmarks/data/perplexity.txt`` (about 2.9k SmolLM2 tokens of this project's
own prose, frozen: a copy, not the live docs). It is cut into windows of ``--window``
tokens; each window is one prefill through the engine (``ModelRunner.prefill`` with
``every_position``), and every token after a window's first is scored by the logits of the
position before it. Reported per storage: perplexity, its ratio to float32, and the share
of positions whose greedy (argmax) token equals float32's.

Storages, all of the same checkpoint: ``none`` (float32, the reference: for the default
model that is its GGUF de-quantized exactly), ``auto`` (a GGUF's blocks served packed),
``int8`` and ``int4`` (quantized at load). A ``+gemm`` suffix scores the same storage with
every linear call on the bfloat16 GEMM that packed layers take for many rows
(``engine/weights/gemm.py``): serving runs each call on one kernel or the other by its
rows, so both must hold; ``+det`` as batch-invariant serving runs a prefill
(``--enable-deterministic-inference``: the layers on that GEMM, the LM head packed). An ``@bfloat16`` suffix runs the activations in bfloat16 too
(``launch --dtype bfloat16``). Targets (issue #21): packed GGUF within 0.5 % of
the float32 reference; int8 within 1 %, int4 within 3 %. Writes
``benchmarks/results/perplexity.md``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from benchmarks.harness.machine import machine_block
from bundled_models.default_model import resolve_model
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.tokenizer.hf_tokenizer import load_tokenizer
from wire.params import SamplingParams

TEXT = Path(__file__).parents[1] / "data" / "perplexity.txt"
RESULTS = Path(__file__).parents[1] / "results" / "perplexity.md"
STORAGES = (
    "none",
    "auto",
    "auto+gemm",
    "auto+det",
    "auto+a8",
    "int8",
    "int4",
    "int4+gemm",
    "int4+a8",
)
TARGETS = {
    "auto": 0.005,
    "auto+gemm": 0.005,
    "auto+det": 0.005,
    "auto+a8": 0.005,
    "int8": 0.01,
    "int4": 0.03,
    "int4+gemm": 0.03,
    "int4+a8": 0.03,
}


def score(
    model: Path, quantization: str, ids: list[int], window: int, by_decode: bool
) -> tuple[float, list[int]]:
    """(mean negative log-likelihood per scored token, the argmax token at each position).

    ``by_decode``: after a 16-token prefill, every further token of a window is fed by one
    decode step (teacher forcing: the text's token, not the model's), so the scores come
    from decode attention over the KV cache as serving reads it (bfloat16 for packed
    weights); otherwise a window is one prefill, which attends over fresh K and V.
    """
    return score_runner(
        build_engine(engine_config(model, quantization, window)).runner, ids, window, by_decode
    )


def engine_config(model: Path, quantization: str, window: int) -> EngineConfig:
    """The engine ``score`` builds for a storage name (``auto+gemm``, ``int4+a8@bfloat16``:
    see the module's docstring), its KV pool a window long."""
    quantization, _, dtype = quantization.partition("@")  # "auto@bfloat16": activations too
    storage, _, suffix = quantization.partition("+")
    # "gemm": every call on the GEMM, from one row on, fed bfloat16; "a8": fed int8;
    # "det": batch-invariant (a prefill's layers on the GEMM, the LM head packed)
    gemm = suffix in ("gemm", "a8", "det")
    return EngineConfig(
        model=str(model),
        dtype=dtype or "auto",
        quantization=storage,
        kv_cache_tokens=window + 64,
        large_batch_gemm=gemm,
        gemm_min_rows=1 if gemm else 0,
        gemm_inputs="int8" if suffix == "a8" else "bfloat16",
        deterministic=suffix == "det",
    )


def score_runner(
    runner: ModelRunner, ids: list[int], window: int, by_decode: bool
) -> tuple[float, list[int]]:
    """``score`` on an engine already built (``benchmarks/engine/int8_schemes.py`` swaps its
    layers' GEMMs first)."""
    rows: list[torch.Tensor] = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]  # the extra token is the last target
        head = min(16, len(chunk) - 1) if by_decode else len(chunk) - 1
        seq = Sequence(start, chunk[:head], sampling=SamplingParams())
        rows.append(runner.prefill([(seq, head)], every_position=True))  # (head, vocab)
        for token in chunk[head:-1]:
            seq.output_ids.append(token)
            rows.append(runner.decode([seq]))  # (1, vocab): the next token's
        runner.kv.free_blocks(seq)
    logits = torch.cat(rows)  # (len(ids) - 1, vocab): position i predicts token i + 1
    targets = torch.tensor(ids[1:])
    nll = -float(torch.log_softmax(logits, dim=-1)[torch.arange(len(targets)), targets].sum())
    return nll / len(targets), logits.argmax(-1).tolist()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.perplexity", description=__doc__)
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--storages", default=",".join(STORAGES))
    p.add_argument(
        "--by-decode",
        action="store_true",
        help="score through decode steps over the KV cache (see score())",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    ids = load_tokenizer(str(model))(TEXT.read_text()).input_ids
    rows, ref_nll, ref_argmax = [], None, None
    for storage in args.storages.split(","):
        t0 = time.perf_counter()
        nll, argmax = score(model, storage, ids, args.window, args.by_decode)
        if ref_nll is None:
            ref_nll, ref_argmax = nll, argmax
        assert ref_argmax is not None
        agree = sum(a == b for a, b in zip(argmax, ref_argmax, strict=True)) / len(argmax)
        ratio = math.exp(nll) / math.exp(ref_nll)
        target = TARGETS.get(storage.partition("@")[0])
        verdict = "" if target is None else ("met" if ratio - 1 <= target else "NOT met")
        rows.append((storage, math.exp(nll), ratio, agree, target, verdict))
        print(
            f"{storage}: ppl {math.exp(nll):.4f} ({ratio:.4f}x), argmax agreement "
            f"{agree:.1%} [{time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    lines = [
        "# Perplexity by weight storage",
        "",
        f"Model: `{model.name}`; text: `benchmarks/data/perplexity.txt`, {len(ids)} tokens, "
        f"windows of {args.window}; threads {args.threads}; scored "
        + ("by decode steps over the KV cache." if args.by_decode else "by one prefill a window."),
        "",
        "Command: `python -m benchmarks.engine.perplexity"
        + (f" --model {args.model.name}" if args.model else "")
        + "`",
        "",
        "| storage | perplexity | vs float32 | target | | argmax = float32's |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for storage, ppl, ratio, agree, target, verdict in rows:
        tgt = "" if target is None else f"<= +{target:.1%}"
        lines.append(f"| {storage} | {ppl:.4f} | {ratio:.4f}x | {tgt} | {verdict} | {agree:.1%} |")
    lines += ["", *machine_block()]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
