"""The paged engine computes the same logits and greedy tokens as transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from wire.params import SamplingParams

PROMPT_LENS = [1, 2, 15, 16, 17, 31, 33, 48, 64, 77, 99, 100]
DECODE_STEPS = 6


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _random_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151_000, (n,), generator=g).tolist()


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole", "chunked"])
def test_prefill_and_decode_logits_match_transformers(
    tiny_model_path: Path, chunk: int | None
) -> None:
    hf = _hf_model(tiny_model_path)
    runner = build_engine(EngineConfig(model=str(tiny_model_path), num_kv_blocks=128)).runner
    full = [_random_tokens(n + DECODE_STEPS, seed=n) for n in PROMPT_LENS]
    with torch.no_grad():
        ref = [hf(torch.tensor([ids])).logits[0] for ids in full]  # (len, vocab) each
    seqs = [
        Sequence(i, ids[:n], sampling=SamplingParams())
        for i, (ids, n) in enumerate(zip(full, PROMPT_LENS))
    ]
    last: dict[int, torch.Tensor] = {}
    # Chunked: every call batches the next <= chunk tokens of every unfinished prompt.
    while pending := [s for s in seqs if s.num_uncomputed_tokens > 0]:
        chunks = [(s, min(s.num_uncomputed_tokens, chunk or s.num_tokens)) for s in pending]
        logits = runner.prefill(chunks)
        for (s, _), row in zip(chunks, logits):
            last[s.rid] = row
    for s, n in zip(seqs, PROMPT_LENS):
        torch.testing.assert_close(last[s.rid], ref[s.rid][n - 1], atol=1e-4, rtol=0)
    for step in range(DECODE_STEPS):
        for s, ids, n in zip(seqs, full, PROMPT_LENS):
            s.output_ids.append(ids[n + step])
        logits = runner.decode(seqs)
        for s, n, row in zip(seqs, PROMPT_LENS, logits):
            torch.testing.assert_close(row, ref[s.rid][n + step], atol=1e-4, rtol=0)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_greedy_generation_matches_transformers_generate(tiny_model_path: Path) -> None:
    hf = _hf_model(tiny_model_path)
    prompts = [_random_tokens(n, seed=100 + n) for n in (5, 23)]
    llm = LLM(EngineConfig(model=str(tiny_model_path), num_kv_blocks=64))
    results = llm.generate(prompts, _greedy(64))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert result.output_ids == out[0, len(prompt) :].tolist()


def test_greedy_tokens_same_alone_and_in_batch_of_32(default_model_path: Path) -> None:
    prompts = [_random_tokens(1 + (7 * i) % 90, seed=200 + i) for i in range(32)]
    llm = LLM(
        EngineConfig(model=str(default_model_path), num_kv_blocks=256, chunked_prefill_size=512)
    )
    batch = llm.generate(prompts, _greedy(64))
    for i in (0, 13, 31):
        alone = llm.generate([prompts[i]], _greedy(64))[0]
        assert alone.output_ids == batch[i].output_ids
        assert len(alone.output_ids) == 64
