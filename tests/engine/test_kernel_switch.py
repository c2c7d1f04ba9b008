"""A decode step's kernel by its rows: what changes, with the packed default model.

Packed layers run torch's int4 kernel for a decode step of few rows and their bfloat16 GEMM
for many (``engine/weights/gemm.py``). The two round differently, so a request decoded alone
and the same request decoded beside others may part; docs/weights_and_kernels.md states how: only after a
near tie. Checked on the default model (SmolLM2, its Q4_1 blocks packed) with the documented
questions: each greedy continuation alone (one row: packed) against all of them in one
batch (every row on the GEMM, ``gemm_min_rows=2``), 24 tokens.
"""

from __future__ import annotations

from bundled_models.default_model import default_model_dir
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.tokenizer.hf_tokenizer import load_tokenizer
from wire.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "Why is the sky blue?",
]
STEPS = 24
# A near tie: the two best logits within 4 bfloat16 steps at 32 (0.25 each): a gap the two
# kernels' roundings of the hidden state can close.
NEAR = 1.0


def _greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations of ``prompts`` decoded together: (tokens, top-2 gap per step)."""
    seqs = [Sequence(i, p, sampling=SamplingParams()) for i, p in enumerate(prompts)]
    logits = runner.prefill([(s, s.num_tokens) for s in seqs])
    gaps: list[list[float]] = [[] for _ in seqs]
    for step in range(STEPS):
        top = logits.topk(2, dim=-1).values  # (B, 2)
        for i, s in enumerate(seqs):
            s.output_ids.append(int(logits[i].argmax()))
            gaps[i].append(float(top[i, 0] - top[i, 1]))
        if step + 1 < STEPS:
            logits = runner.decode(seqs)
    for s in seqs:
        runner.kv.free_blocks(s)
    return [(list(s.output_ids), g) for s, g in zip(seqs, gaps, strict=True)]


def test_a_request_alone_and_in_a_batch_part_only_after_a_near_tie() -> None:
    path = default_model_dir()
    tok = load_tokenizer(str(path))
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    config = EngineConfig(
        model=str(path), num_kv_blocks=128, large_batch_gemm=True, gemm_min_rows=2
    )
    runner = build_engine(config).runner
    assert runner.quantization == "gguf"
    together = _greedy(runner, prompts)
    for prompt, (batched, batched_gaps) in zip(prompts, together, strict=True):
        [(alone, alone_gaps)] = _greedy(runner, [prompt])
        if alone == batched:
            continue
        first = next(i for i, (a, b) in enumerate(zip(alone, batched, strict=True)) if a != b)
        gap = min(alone_gaps[first], batched_gaps[first])
        assert gap < NEAR, (tok.decode(alone), tok.decode(batched), first, gap)
