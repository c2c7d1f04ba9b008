"""Prefill and decode schedulers wired in one process reproduce transformers' greedy output.

This pins the disaggregated request life without processes: prefill computes the prompt
and samples the first token, its blocks are pinned and copied into the decode pool
block by block (the shm backend over a plain tensor), decode continues the request.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
import torch

from decode.scheduler import DecodeScheduler
from prefill.scheduler import SHARED_CHUNK, PrefillScheduler
from tests.pipeline.drive import pair, run
from wire.params import SamplingParams
from wire.records import Finish, GenerateRequest


def _pair(model: Path, decode_blocks: int = 256) -> tuple[PrefillScheduler, DecodeScheduler]:
    return pair(model, chunk_budget=48, decode_blocks=decode_blocks)


def _run(prefill: PrefillScheduler, decode: DecodeScheduler) -> dict[int, list[int]]:
    """rid -> output ids by position."""
    return {rid: ids for rid, (ids, _) in run(prefill, decode).items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_disaggregated_greedy_matches_transformers(arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from bundled_models.tiny import tiny_model_dir

    model = tiny_model_dir(arch)
    prefill, decode = _pair(model)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (1, 17, 40, 95)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for rid, prompt in enumerate(prompts):
        req = GenerateRequest(
            rid=rid, prompt_ids=prompt, sampling=params, decode_worker=0, detok_shard=0
        )
        assert prefill.add(req) == Finish.NONE
    got = _run(prefill, decode)

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for rid, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert got[rid] == want[0, len(prompt) :].tolist(), f"rid {rid}"
    # Every block came back: nothing used, nothing pinned on either side.
    for runner in (prefill.runner, decode.runner):
        a = runner.kv.allocator
        assert a.num_used == 0 and a.num_pinned == 0 and a.num_available == a.num_blocks


def test_preemption_recomputes_and_keeps_output(default_model_path: Path) -> None:
    """A decode pool too small for every request preempts and recomputes; output unchanged."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[100 + i] * 30 for i in range(6)]

    def run(decode_blocks: int) -> dict[int, list[int]]:
        prefill, decode = _pair(default_model_path, decode_blocks)
        for rid, prompt in enumerate(prompts):
            prefill.add(
                GenerateRequest(
                    rid=rid, prompt_ids=prompt, sampling=params, decode_worker=0, detok_shard=0
                )
            )
        return _run(prefill, decode)

    assert run(decode_blocks=14) == run(decode_blocks=256)


def test_abort_frees_blocks_everywhere(default_model_path: Path) -> None:
    prefill, decode = _pair(default_model_path)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for rid in range(3):
        prefill.add(
            GenerateRequest(
                rid=rid, prompt_ids=[5] * 20, sampling=params, decode_worker=0, detok_shard=0
            )
        )
    for _, t in prefill.step().transfers:
        decode.offer(t)
    for _, rel in decode.admit():
        prefill.release(rel.rid)
    decode.step()
    for rid in range(3):  # the frontend fans an abort out to both workers
        prefill.abort(rid)
        decode.abort(rid)
    assert prefill.waiting == deque()
    assert decode.running == {} and decode.runner.kv.allocator.num_used == 0
    assert prefill.runner.kv.allocator.num_pinned == 0 and prefill.runner.kv.allocator.num_used == 0


def test_a_cpu_prefill_step_takes_one_chunk_of_a_burst(default_model_path: Path) -> None:
    """With more than one prompt waiting, a CPU prefill step takes SHARED_CHUNK tokens, so
    the first prompt's token and KV handoff leave before the others are computed; a prompt
    alone takes the whole budget. First tokens are those of any other budget."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = {0: [5] * SHARED_CHUNK, 1: [6] * SHARED_CHUNK, 2: [7] * 600}

    def go(budget: int) -> tuple[list[int], dict[int, int]]:
        prefill, _ = pair(default_model_path, chunk_budget=budget)
        ran: list[int] = []
        first: dict[int, int] = {}
        for rid in (0, 1):
            prefill.add(GenerateRequest(rid, prompts[rid], params, 0, 0))
        for step in range(12):
            if step == 2:  # prompt 1 is alone by now, or not, by the budget
                prefill.add(GenerateRequest(2, prompts[2], params, 0, 0))
            out = prefill.step()
            ran.append(out.ran_tokens)
            for batch in out.tokens.values():
                first.update(zip(batch.rids.tolist(), batch.token_ids.tolist()))
            if step >= 2 and not prefill.waiting:
                break
        return ran, first

    ran, first = go(2048)
    # Two waiting: one chunk of SHARED_CHUNK; then each alone: its whole prompt.
    assert ran == [SHARED_CHUNK, SHARED_CHUNK, 600]
    small_ran, small_first = go(SHARED_CHUNK // 2)  # a budget below it stays as it is
    assert max(small_ran) == SHARED_CHUNK // 2 and sum(small_ran) == 2 * SHARED_CHUNK + 600
    assert first == small_first and set(first) == {0, 1, 2}
