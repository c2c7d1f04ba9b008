"""Batch-invariant inference (engine/model/batch_invariance.py): a row's bits do not depend on
the rows beside it, the GEMM's row count, the threads, or how its prompt was computed."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from colocated.llm import LLM, GenerationResult
from engine.config import EngineConfig
from engine.kernels.cpu.ops import decode_attention_op
from engine.model.batch_invariance import make_batch_invariant
from engine.weights.linear import packed_kernel
from engine.weights.quant import quantize_int8
from engine.weights.refined_head import RefinedHead
from engine.weights.row_tiles import ROW_TILE, tiled_linear
from wire.params import SamplingParams


@pytest.fixture
def one_thread_after() -> object:
    threads = torch.get_num_threads()
    yield None
    torch.set_num_threads(threads)


def test_tiled_linear_gives_a_row_its_bits_whatever_its_neighbours_and_threads(
    one_thread_after: object,
) -> None:
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    row = torch.randn(64, generator=g)
    want = tiled_linear(row[None], w, bias)[0]
    for rows, at, threads in ((1, 0, 1), (2, 1, 2), (ROW_TILE, 7, 2), (37, 20, 1), (37, 36, 2)):
        torch.set_num_threads(threads)
        x = torch.randn(rows, 64, generator=g)
        x[at] = row
        assert torch.equal(tiled_linear(x, w, bias)[at], want), (rows, at, threads)
    # The reference it replaces is F.linear's product within rounding.
    assert torch.allclose(want, torch.nn.functional.linear(row, w, bias), atol=1e-4)


def test_refined_head_row_invariant_logits_do_not_depend_on_the_batch(
    one_thread_after: object,
) -> None:
    g = torch.Generator().manual_seed(1)
    rows = quantize_int8(torch.randn(320, 576, generator=g))
    head = RefinedHead(packed_kernel(rows, torch.bfloat16, torch.device("cpu")), rows)
    head.row_invariant = True
    x = torch.randn(9, 576, generator=g)
    # A zero row ties all its logits: the batch's widest near count becomes the most
    # refined (64), which moved a batched product's sums for the other rows.
    x[3] = 0.0
    torch.set_num_threads(1)
    want = head.forward(x[:1], None)[0]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for batch in (x[:2], x[:5], x):
            assert torch.equal(head.forward(batch, None)[0], want)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=0.8, seed=7 + i, max_tokens=10, logprobs=5, ignore_eos=True)
    for i in range(3)
]


def _bits(r: GenerationResult) -> tuple[object, ...]:
    return (r.output_ids, r.logprobs, r.top_logprobs)


@pytest.fixture(scope="module")
def invariant(default_model_path: Path) -> LLM:
    return LLM(EngineConfig(model=str(default_model_path), num_kv_blocks=256, deterministic=True))


def test_same_bits_alone_batched_chunked_and_cached(invariant: LLM) -> None:
    """The torch reference path (tiny float32 model): tokens and logprobs equal as floats
    alone, among other requests of other lengths, after a prefix-cache hit, and with the
    prompt cut into chunks."""
    prompts = _prompts(6, 0)
    params = [GREEDY, GREEDY, GREEDY, *SAMPLED]
    alone = [_bits(invariant.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]
    others = _prompts(10, 1)
    background = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + i) for i in range(10)]
    batched = invariant.generate(prompts + others, params + background)[: len(prompts)]
    assert [_bits(r) for r in batched] == alone
    cached = [_bits(invariant.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]
    assert cached == alone  # every prompt's full blocks came from the prefix cache
    config = replace(invariant.config, chunked_prefill_size=16, enable_prefix_caching=False)
    chunked = LLM(config).generate(prompts + others[:4], params + background[:4])
    assert [_bits(r) for r in chunked[: len(prompts)]] == alone


def test_recomputed_kv_equals_what_decode_steps_wrote(invariant: LLM) -> None:
    """A prompt that ends in a greedy answer's first tokens (a request resumed elsewhere,
    a follow-up turn) predicts the next token with the logprobs its decode step gave."""
    prompt = _prompts(1, 2)[0]
    first = invariant.generate([prompt], GREEDY)[0]
    assert first.logprobs is not None
    for cut in (1, 4, 7):
        resumed = invariant.generate([prompt + first.output_ids[:cut]], GREEDY)[0]
        assert resumed.output_ids[0] == first.output_ids[cut]
        assert resumed.logprobs is not None and first.top_logprobs is not None
        assert resumed.logprobs[0] == first.logprobs[cut]
        assert resumed.top_logprobs is not None
        assert resumed.top_logprobs[0] == first.top_logprobs[cut]


def test_switch_reaches_every_linear_layer(default_model_path: Path, invariant: LLM) -> None:
    model = invariant.runner.model
    changed = make_batch_invariant(model)  # idempotent: the runner already applied it
    assert changed["dense"] > 0
    tiles = {m.kernel.row_tile for m in model.modules() if hasattr(m, "kernel")}
    assert tiles == {ROW_TILE}
    assert invariant.runner.mixes_batches is False


def test_same_bits_at_one_thread_and_two(invariant: LLM, one_thread_after: object) -> None:
    """A CPU worker's core lease grants a step 1 or 2 threads by what the other workers
    do (transport/core_lease.py): a request's bits do not follow (the CPU SDPA kernel's
    sums for a one-row call did, at most context lengths)."""
    prompts = _prompts(5, 3)
    params = [GREEDY, GREEDY, *SAMPLED]
    torch.set_num_threads(1)
    one = [_bits(invariant.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]
    torch.set_num_threads(2)
    two = [_bits(invariant.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]
    assert two == one
    assert torch.get_num_threads() == 2  # the attention's one-thread calls restore it


@pytest.fixture(scope="module")
def packed_invariant() -> LLM:
    """SmolLM2 as served by default (GGUF Q4_1 packed, pdserve's fused CPU kernels)."""
    from bundled_models.default_model import default_model_dir

    if decode_attention_op() is None:
        pytest.skip("pdserve's CPU kernels do not run here: SmolLM2 would take the torch path")
    config = EngineConfig(
        model=str(default_model_dir()), kv_cache_tokens=8192, max_model_len=1024, deterministic=True
    )
    return LLM(config)


def test_packed_default_one_arithmetic_for_prompt_and_generated_rows(
    packed_invariant: LLM,
) -> None:
    """On the packed default a prompt's rows run the decode step's arithmetic (the packed
    kernel, the decode attention): the same bits alone, among others, cached, at one
    thread, and for a prompt holding a greedy answer's first tokens (a request resumed on
    another worker) the logprobs its decode step gave."""
    llm = packed_invariant
    assert type(llm.runner.backend).__name__ == "FusedCpuBackend"
    prompts = _prompts(4, 5)
    params = [GREEDY, GREEDY, GREEDY, SAMPLED[0]]
    results = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    alone = [_bits(r) for r in results]
    others = _prompts(12, 6)
    background = [SamplingParams(temperature=1.0, seed=i, max_tokens=20) for i in range(12)]
    batched = llm.generate(prompts + others, params + background)[: len(prompts)]
    assert [_bits(r) for r in batched] == alone  # decode steps of up to 16 rows
    assert [_bits(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params)] == alone
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _bits(llm.generate([prompts[0]], [GREEDY])[0]) == alone[0]
    finally:
        torch.set_num_threads(threads)
    for prompt, first in zip(prompts[:3], results):
        assert first.logprobs is not None and first.top_logprobs is not None
        for cut in (1, 6):
            resumed = llm.generate([prompt + first.output_ids[:cut]], GREEDY)[0]
            assert resumed.output_ids[0] == first.output_ids[cut]
            assert resumed.logprobs is not None and resumed.top_logprobs is not None
            assert resumed.logprobs[0] == first.logprobs[cut]
            assert resumed.top_logprobs[0] == first.top_logprobs[cut]
