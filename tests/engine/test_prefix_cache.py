"""Prefix caching reuses exactly the cached prefix and changes no output.

Greedy generations with caching on equal those with it off and transformers', for
prompts sharing prefixes of many lengths around block boundaries (block size 16), for
fully cached prompts, chunked prefill, and a second turn that reuses the first's answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from wire.params import SamplingParams

BS = 16
BASE_LEN = 100
# (shared prefix, own suffix) lengths: the shared part ends mid-block, a token short of a
# boundary, on it or past it; whole prompts end on a boundary (16, 32, 48, 80), a token
# short of one (31, 47) or elsewhere.
SHAPES = [
    (0, 16),
    (1, 8),
    (7, 9),
    (15, 1),
    (16, 15),
    (17, 15),
    (31, 2),
    (32, 16),
    (33, 14),
    (47, 1),
    (48, 3),
    (63, 17),
    (64, 1),
    (80, 12),
    (96, 20),
]
SHARED = [k for k, _ in SHAPES]
MAX_TOKENS = 8


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(base: list[int]) -> list[list[int]]:
    """base[:k] + a suffix of its own, for each shape."""
    out = []
    for i, (k, n) in enumerate(SHAPES):
        suffix = _tokens(n, seed=1000 + i)
        suffix[0] = (base[k] + 1) % 150_000  # the shared prefix is exactly k tokens
        out.append(base[:k] + suffix)
    return out


def _expected_hit(prompt: list[int], shared: int) -> int:
    # Whole blocks of the shared prefix, stopping before the prompt's last token's block.
    return min(shared // BS, (len(prompt) - 1) // BS) * BS


def _llm(model: Path, caching: bool, chunk: int = 2048) -> LLM:
    return LLM(
        EngineConfig(
            model=str(model),
            num_kv_blocks=256,
            chunked_prefill_size=chunk,
            enable_prefix_caching=caching,
        )
    )


@pytest.mark.parametrize("chunk", [2048, 24], ids=["whole", "chunked"])
def test_shared_prefixes_reuse_exactly_the_cached_blocks_and_match_transformers(
    default_model_path: Path, chunk: int
) -> None:
    from transformers import AutoModelForCausalLM

    base = _tokens(BASE_LEN, seed=1)
    prompts = _prompts(base)
    on, off = _llm(default_model_path, True, chunk), _llm(default_model_path, False, chunk)
    for llm in (on, off):
        llm.generate([base], _greedy())
    stats = on.runner.kv.allocator.stats
    hits_before, queried_before = stats.hit_tokens, stats.queried_tokens
    got_on = [r.output_ids for r in on.generate(prompts, _greedy())]
    assert stats.hit_tokens - hits_before == sum(
        _expected_hit(p, k) for p, k in zip(prompts, SHARED)
    )
    assert stats.queried_tokens - queried_before == sum(len(p) for p in prompts)
    got_off = [r.output_ids for r in off.generate(prompts, _greedy())]
    assert off.runner.kv.allocator.num_hashed == 0 and off.runner.kv.allocator.stats.hit_tokens == 0
    assert got_on == got_off

    # Every prompt again: now each is cached whole, block-aligned ones included.
    hits_before = stats.hit_tokens
    assert [r.output_ids for r in on.generate(prompts, _greedy())] == got_on
    assert stats.hit_tokens - hits_before == sum((len(p) - 1) // BS * BS for p in prompts)

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, got_on):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out == want[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"
    on.runner.kv.allocator.check_invariants()
    assert on.runner.kv.allocator.num_used == 0 and on.runner.kv.allocator.num_cached > 0


def test_a_second_turn_reuses_the_first_turns_answer(default_model_path: Path) -> None:
    on, off = _llm(default_model_path, True), _llm(default_model_path, False)
    first = _tokens(40, seed=2)
    (answer,) = on.generate([first], _greedy(30))
    # Decode published the blocks its answer filled: prompt + answer minus the last token.
    history = first + answer.output_ids
    second = history + _tokens(9, seed=3)
    stats = on.runner.kv.allocator.stats
    before = stats.hit_tokens
    (reply,) = on.generate([second], _greedy())
    assert stats.hit_tokens - before == (len(history) - 1) // BS * BS == 64
    assert reply.output_ids == off.generate([second], _greedy())[0].output_ids


def test_a_fully_cached_prompt_never_writes_into_a_shared_block(
    default_model_path: Path,
) -> None:
    runner = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=16)).runner
    prompt = _tokens(3 * BS, seed=4)
    owner = Sequence(0, list(prompt), block_size=BS)
    runner.prefill([(owner, len(prompt))])  # holds its 3 blocks, all published
    cached = runner.kv.tensor[owner.block_table].clone()
    reader = Sequence(1, list(prompt), block_size=BS)
    assert runner.kv.reuse_prefix(reader) == 2 * BS  # the last block is recomputed
    assert reader.block_table[:2] == owner.block_table[:2]
    logits = runner.prefill([(reader, BS)])
    assert reader.block_table[2] != owner.block_table[2]
    assert torch.equal(runner.kv.tensor[owner.block_table], cached)
    alone = build_engine(
        EngineConfig(model=str(default_model_path), num_kv_blocks=16, enable_prefix_caching=False)
    ).runner
    fresh = Sequence(2, list(prompt), block_size=BS)
    torch.testing.assert_close(logits, alone.prefill([(fresh, len(prompt))]), atol=1e-5, rtol=0)
    for seq in (owner, reader):
        runner.kv.free_blocks(seq)
    runner.kv.allocator.check_invariants()
    assert runner.kv.allocator.num_cached == 3 and runner.kv.allocator.num_free == 13


def test_caching_off_hashes_nothing_and_reuses_nothing(default_model_path: Path) -> None:
    runner = build_engine(
        EngineConfig(model=str(default_model_path), num_kv_blocks=16, enable_prefix_caching=False)
    ).runner
    prompt = _tokens(40, seed=5)
    for rid in range(2):
        seq = Sequence(rid, list(prompt), block_size=BS)
        assert runner.kv.reuse_prefix(seq) == 0 and seq.block_table == []
        runner.prefill([(seq, len(prompt))])
        runner.kv.free_blocks(seq)
    a = runner.kv.allocator
    assert (a.num_hashed, a.num_cached, a.num_free, a.stats.queried_tokens) == (0, 0, 16, 0)
