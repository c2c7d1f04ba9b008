"""Runner contract the workers rely on: external pools, block handoff, limits, stops."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig, ModelConfig
from engine.errors import NoFreeBlocks, PromptTooLongError
from engine.kv.kv_cache import pool_layout
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.sampling.stops import Stops
from wire.params import SamplingParams
from wire.records import Finish

PROMPT = list(range(300, 340))  # 40 tokens: 3 blocks of 16


def _runner(path: Path, **kw: object) -> ModelRunner:
    return build_engine(EngineConfig(model=str(path), **kw)).runner  # type: ignore[arg-type]


def _seq(runner: ModelRunner, prompt: list[int], **params: object) -> Sequence:
    return Sequence(
        0, list(prompt), sampling=SamplingParams(**params), block_size=runner.block_size
    )  # type: ignore[arg-type]


def test_kv_written_to_an_external_shared_pool_and_copied_blocks_decode_elsewhere(
    default_model_path: Path,
) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    layout = pool_layout(m, 8, 16, torch.float32)
    nbytes = layout.nbytes
    shared = mmap.mmap(-1, nbytes)  # stands in for a POSIX shm segment
    pool = torch.frombuffer(shared, dtype=torch.float32).view(layout.shape)
    prefill = build_engine(EngineConfig(model=str(default_model_path)), kv_pool=pool).runner
    assert prefill.kv.allocator.num_blocks == 8
    assert prefill.kv.tensor.data_ptr() == pool.data_ptr()
    seq = _seq(prefill, PROMPT)
    prefill.prefill([(seq, len(PROMPT))])
    assert any(shared[:nbytes])  # the KV landed in the shared bytes

    # A second runner receives whole blocks into different block ids, as the transport does.
    decode = _runner(default_model_path, num_kv_blocks=8)
    decode.kv.allocator.allocate(2)  # make the destination ids differ from the source ids
    moved = Sequence(0, list(PROMPT), sampling=seq.sampling, num_computed_tokens=len(PROMPT))
    decode.kv.ensure_blocks(moved, 0)
    decode.kv.tensor[moved.block_table] = prefill.kv.tensor[seq.block_table]
    for s in (seq, moved):
        s.output_ids.append(77)
    torch.testing.assert_close(decode.decode([moved]), prefill.decode([seq]), atol=1e-5, rtol=0)


def test_external_pool_of_wrong_shape_is_rejected(default_model_path: Path) -> None:
    with pytest.raises(ValueError, match="shape"):
        build_engine(EngineConfig(model=str(default_model_path)), kv_pool=torch.zeros(4, 2, 2))


def test_out_of_blocks_is_typed_and_leaves_the_sequence_untouched(
    default_model_path: Path,
) -> None:
    runner = _runner(default_model_path, num_kv_blocks=2)
    seq = _seq(runner, PROMPT)
    with pytest.raises(NoFreeBlocks):
        runner.prefill([(seq, len(PROMPT))])
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert runner.kv.allocator.num_free == 2
    runner.prefill([(seq, 32)])  # what fits still runs
    assert seq.num_computed_tokens == 32 and len(seq.block_table) == 2
    runner.kv.free_blocks(seq)
    runner.kv.allocator.check_invariants()
    assert runner.kv.allocator.num_available == 2


def test_max_model_len_is_enforced(default_model_path: Path) -> None:
    runner = _runner(default_model_path, max_model_len=42, num_kv_blocks=8)
    seq = _seq(runner, PROMPT, max_tokens=100, ignore_eos=True)
    runner.prefill([(seq, len(PROMPT))])
    seq.output_ids.append(5)
    stops = Stops(runner.model_config.eos_token_ids, runner.max_model_len)
    assert stops.check(seq) is Finish.NONE  # 41 tokens
    runner.decode([seq])
    seq.output_ids.append(6)
    assert stops.check(seq) is Finish.LENGTH  # 42 tokens
    runner.decode([seq])  # position 41 still fits; a 43rd token would not
    seq.output_ids.append(7)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.decode([seq])
    llm = LLM(EngineConfig(model=str(default_model_path), max_model_len=42, num_kv_blocks=8))
    with pytest.raises(PromptTooLongError):
        llm.generate([list(range(42))], SamplingParams())
    (result,) = llm.generate([PROMPT], SamplingParams(max_tokens=100, ignore_eos=True))
    assert result.finish is Finish.LENGTH and len(result.output_ids) == 2


@pytest.mark.parametrize(
    ("params", "token", "expected"),
    [
        ({}, 151645, Finish.STOP),  # EOS from generation_config.json
        ({"ignore_eos": True}, 151645, Finish.NONE),
        ({"stop_token_ids": (9,)}, 9, Finish.STOP),
        ({"stop_token_ids": (9,), "ignore_eos": True}, 9, Finish.STOP),
        ({"max_tokens": 1}, 9, Finish.LENGTH),
        ({}, 9, Finish.NONE),
    ],
)
def test_stop_checks(
    default_model_path: Path, params: dict[str, object], token: int, expected: Finish
) -> None:
    engine = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=4))
    seq = _seq(engine.runner, PROMPT, **params)
    seq.output_ids.append(token)
    assert engine.stops.check(seq) is expected


def test_preemption_under_a_small_pool_keeps_greedy_outputs(default_model_path: Path) -> None:
    prompts = [list(range(1000 + 50 * i, 1000 + 50 * i + 20 + i)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = LLM(EngineConfig(model=str(default_model_path), num_kv_blocks=64))
    tight = LLM(
        EngineConfig(model=str(default_model_path), num_kv_blocks=8, chunked_prefill_size=16)
    )
    expected = [r.output_ids for r in roomy.generate(prompts, params)]
    assert [r.output_ids for r in tight.generate(prompts, params)] == expected
    tight.runner.kv.allocator.check_invariants()
    assert tight.runner.kv.allocator.num_available == 8


def test_seeded_sampling_is_the_same_alone_and_batched_with_logprobs(
    default_model_path: Path,
) -> None:
    llm = LLM(EngineConfig(model=str(default_model_path), num_kv_blocks=64))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=12, logprobs=3)
    noisy = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0]
    batch = llm.generate([PROMPT[:7], PROMPT, PROMPT[5:]], [noisy, seeded, noisy])
    assert batch[1].output_ids == alone.output_ids
    assert alone.logprobs is not None and alone.top_logprobs is not None
    assert len(alone.logprobs) == len(alone.output_ids)
    for lp, top in zip(alone.logprobs, alone.top_logprobs):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] >= lp - 1e-6
    assert batch[0].logprobs is None


def test_cpu_pools_commit_memory_only_as_blocks_are_written(default_model_path: Path) -> None:
    """A pool is not zero-filled up front: a 1 GiB pool costs (almost) no RSS until used,
    and reads as zeros (padded attention reads slots no token wrote)."""
    from engine.config import ModelConfig
    from engine.kv.kv_cache import allocate_kv_pool

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    m = ModelConfig.from_pretrained(default_model_path)
    blocks = (1 << 30) // pool_layout(m, 1, 16, torch.float32).block_nbytes
    before = rss()
    pool = allocate_kv_pool(m, blocks, 16, torch.float32)
    assert rss() - before < 64 << 20
    assert float(pool[blocks // 2].abs().sum()) == 0.0
    pool[:4].fill_(1.0)  # writing commits what is written, no more
    assert rss() - before < (64 << 20) + 4 * pool_layout(m, 1, 16, torch.float32).block_nbytes
