"""Structured output on the engine: grammar compile times, and what a constrained decode
step costs over an unconstrained one once its grammar is compiled.

The decode step is what a decode worker runs each step: one batched forward
(``ModelRunner.decode``), then ``ModelRunner.sample`` (greedy), then appending each row's
token (which advances its grammar matcher). The same batch is timed with no row
constrained, half and all of them under a JSON schema whose strings have a maxLength
(xgrammar's costly case), and all under one whose strings have none; each case has a
runner of its own, steps interleave the cases so background load hits all alike, and
medians are reported. Both schemas keep every row inside the grammar for every timed
step. Compile times are cold (no cache) per schema, plus the one-off vocabulary build a
process pays on its first grammar (cold and from the disk cache).

    python -m benchmarks.engine.structured_output [--batch 32] [--steps 48] [--threads 2] [--models tiny,smollm2]

Writes benchmarks/results/structured_output.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.machine import describe as describe_machine
from bundled_models import tiny
from bundled_models.default_model import default_model_dir
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.sampling.grammar import GrammarCache
from wire.params import GrammarKind, GrammarSpec, SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "structured_output.md"
CONTEXT = 64
# Both stay open for every timed step: 64 strings, each at least `"", ` (3 tokens). The
# first bounds its strings (xgrammar's costly case: a counted repetition), the second not.
STEP_SCHEMAS: dict[str, Any] = {
    "strings with maxLength": {
        "type": "array",
        "items": {"type": "string", "maxLength": 32},
        "minItems": 64,
        "maxItems": 64,
    },
    "strings, no maxLength": {
        "type": "array",
        "items": {"type": "string"},
        "minItems": 64,
        "maxItems": 64,
    },
}
COMPILE_SCHEMAS: dict[str, Any] = {
    "flat object (2 fields)": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested + enum + array": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["id"],
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["user", "tags"],
    },
    "20 properties": {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(20)
        },
        "required": [f"field_{i}" for i in range(0, 20, 2)],
    },
}


def _spec(schema: Any) -> GrammarSpec:
    return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(schema))


def _batch(runner: ModelRunner, n: int, constrained: int, schema: Any) -> list[Sequence]:
    """``n`` prefilled sequences; the first ``constrained`` under ``schema``."""
    g = torch.Generator().manual_seed(n + constrained)
    seqs = []
    for i in range(n):
        grammar = _spec(schema) if i < constrained else None
        # Greedy: the step's sampling costs the same in every case, so the difference
        # between them is the grammar's (mask fill, mask apply, matcher advance).
        params = SamplingParams(
            max_tokens=10_000, temperature=0.0, ignore_eos=True, grammar=grammar
        )
        prompt = torch.randint(0, runner.model_config.vocab_size, (CONTEXT,), generator=g).tolist()
        seqs.append(
            Sequence(rid=i, prompt_ids=prompt, sampling=params, block_size=runner.block_size)
        )
    logits = runner.prefill([(s, CONTEXT) for s in seqs])
    out = runner.sample(logits, seqs)  # builds the matchers (compiled once, then cached)
    for s, t in zip(seqs, out.token_ids.tolist(), strict=True):
        s.append_token(t)
    return seqs


def _step(runner: ModelRunner, seqs: list[Sequence]) -> float:
    t0 = time.perf_counter()
    logits = runner.decode(seqs)
    out = runner.sample(logits, seqs)
    for s, t in zip(seqs, out.token_ids.tolist(), strict=True):
        s.append_token(t)
    return time.perf_counter() - t0


def bench_steps(model_dir: Path, batch: int, steps: int) -> dict[str, list[float]]:
    bounded, unbounded = STEP_SCHEMAS.values()
    cases = {
        "none": (0, bounded),
        "half, strings with maxLength": (batch // 2, bounded),
        "all, strings with maxLength": (batch, bounded),
        "all, strings without maxLength": (batch, unbounded),
    }
    kv_tokens = batch * (CONTEXT + steps + 8)
    runners, groups = {}, {}
    for name, (k, schema) in cases.items():
        # NOTE: a runner per case: on CPU a runner keeps its batch's K/V dense between
        # steps, and alternating batches on one runner would rebuild it every step.
        runner = build_engine(
            EngineConfig(
                model=str(model_dir),
                dtype="float32",
                num_kv_blocks=kv_tokens // 16 + batch,
                max_model_len=1024,
            )
        ).runner
        runner.grammars.prepare(_spec(schema)).result()  # compiled before timing
        runners[name], groups[name] = runner, _batch(runner, batch, k, schema)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(steps):
        for name, seqs in groups.items():
            times[name].append(_step(runners[name], seqs))
    for name, seqs in groups.items():  # every constrained row stayed inside its grammar
        assert all(
            s.grammar is None or not (s.grammar.failed or s.grammar.terminated) for s in seqs
        ), name
    return times


def bench_compile() -> tuple[dict[str, float], float, float]:
    """Cold compile seconds per schema; vocabulary build cold and from the disk cache."""
    from transformers import AutoTokenizer

    model = str(tiny.tiny_model_dir())
    vocab = 151936

    def fresh(model_dir: str | None) -> tuple[GrammarCache, float]:
        cache = GrammarCache(
            lambda: AutoTokenizer.from_pretrained(model),
            vocab,
            [151645, 151643],
            model_dir=model_dir,
        )
        t0 = time.perf_counter()
        cache.compile_now(GrammarSpec(kind=GrammarKind.REGEX, text="x"))  # vocabulary only
        return cache, time.perf_counter() - t0

    _, cold_vocab = fresh(None)  # no disk cache: tokenizer load + vocabulary decode
    fresh(model)  # make sure the disk cache exists
    cache, cached_vocab = fresh(model)
    compile_s = {}
    for name, schema in COMPILE_SCHEMAS.items():
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            cache.compile_now(_spec(schema))
            runs.append(time.perf_counter() - t0)
        compile_s[name] = statistics.median(runs)
    return compile_s, cold_vocab, cached_vocab


MODELS = {
    "tiny": ("tiny Qwen2 (random weights, 152k vocabulary)", tiny.tiny_model_dir),
    "smollm2": ("SmolLM2-135M-Instruct (49k vocabulary)", default_model_dir),
}


def render(
    times: dict[str, dict[str, list[float]]],
    compiles: tuple[dict[str, float], float, float],
    args: argparse.Namespace,
    command: str,
) -> str:
    lines = [
        "# Structured output: constrained decode step and grammar compile time",
        "",
        f"Command: `{command}`",
        "",
        "```",
        describe_machine(),
        "```",
        "",
    ]
    for model, model_times in times.items():
        lines += _step_table(MODELS[model][0], model_times, args)
    lines += _compile_lines(compiles)
    return "\n".join(lines)


def _step_table(label: str, times: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    base = statistics.median(times["none"]) * 1e3
    lines = [
        f"## Decode step, batch {args.batch}, {label} on CPU ({args.threads} torch threads)",
        "",
        f"Median over {args.steps} interleaved steps (forward + greedy sample + matcher "
        "advance); "
        f"{CONTEXT}-token prompts. Schemas: "
        + "; ".join(f"{k} `{json.dumps(v)}`" for k, v in STEP_SCHEMAS.items())
        + ".",
        "",
        "| rows constrained | step (ms, median) | p90 (ms) | overhead vs unconstrained |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        p90 = sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3
        lines.append(
            f"| {name} | {med:.2f} | {p90:.2f} | {med - base:+.2f} ms "
            f"({(med / base - 1) * 100:+.0f} %) |"
        )
    return [*lines, ""]


def _compile_lines(compiles: tuple[dict[str, float], float, float]) -> list[str]:
    compile_s, cold_vocab, cached_vocab = compiles
    return [
        "## Compile time per schema (tiny Qwen2's vocabulary; cold, median of 3)",
        "",
        "| schema | compile (ms) |",
        "| --- | ---: |",
        *[f"| {name} | {s * 1e3:.1f} |" for name, s in compile_s.items()],
        "",
        "Once per process, on its first grammar: the vocabulary as the grammar engine sees it, "
        f"built from the tokenizer in {cold_vocab:.2f} s, or read from the disk cache "
        f"(engine/sampling/grammar_vocab.py) in {cached_vocab:.2f} s. Compiles run on a thread of "
        "their own (the GIL is released), so other requests' steps go on meanwhile.",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="tiny,smollm2", help="of " + ",".join(MODELS))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    times = {m: bench_steps(MODELS[m][1](), args.batch, args.steps) for m in args.models.split(",")}
    compiles = bench_compile()
    command = "python -m benchmarks.engine.structured_output " + " ".join(sys.argv[1:])
    text = render(times, compiles, args, command.strip())
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
