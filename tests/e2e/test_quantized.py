"""Quantized weights through the whole pipeline: prefill, the P->D handoff, decode, prefix
caching and recovery from a decode worker's death, with ``--quantization int8|int4``.

The reference is the in-process engine with the same quantization (greedy): the launched
tree must produce what one process produces from the same packed weights (a request
resumed after a worker's death excepted: see the last test).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from bundled_models import tiny
from colocated.llm import LLM
from engine.config import EngineConfig
from tests.conftest import LaunchedServer
from tests.e2e.helpers import children, concurrent_greedy, title
from wire.params import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request: pytest.FixtureRequest) -> Iterator[tuple[str, LaunchedServer]]:
    srv = LaunchedServer(
        [
            *shlex.split(
                "--prefill 1 --decode 2 --device cpu --kv-cache-tokens 8192 --max-model-len 1024 --quantization"
            ),
            request.param,
            "--stall-timeout",
            "4",
        ]
    )
    srv.wait_ready()
    yield request.param, srv
    srv.stop()


def _reference(quantization: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    # As the launched tree runs it: packed layers hold a bfloat16 GEMM for many rows.
    config = EngineConfig(
        model=str(model), num_kv_blocks=256, quantization=quantization, large_batch_gemm=True
    )
    llm = LLM(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.output_ids for r in llm.generate(prompts, params)]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150_000, (3 + 11 * i,), generator=g).tolist() for i in range(n)]


def test_served_tokens_equal_the_in_process_engine(quantized: tuple[str, LaunchedServer]) -> None:
    """One request at a time, against the engine run on each prompt alone: the prefill
    worker's bfloat16 GEMM rounds a prompt's KV a little otherwise when it shares its batch
    with other prompts (oneDNN blocks by rows), and a decode batch past the crossover runs
    the GEMM, so only the same batches compare exactly."""
    quantization, srv = quantized
    prompts = _prompts(4, seed=1)
    got = [
        asyncio.run(concurrent_greedy(srv.url, [p], MAX_TOKENS))[0]["output_ids"] for p in prompts
    ]
    assert got == [_reference(quantization, [p], MAX_TOKENS)[0] for p in prompts]


def test_a_repeated_prompt_reuses_its_cached_prefix(quantized: tuple[str, LaunchedServer]) -> None:
    _, srv = quantized
    prompt = _prompts(4, seed=5)[3] * 3  # 108 tokens: six full blocks
    first, second = (asyncio.run(concurrent_greedy(srv.url, [prompt], 8))[0] for _ in range(2))
    assert second["output_ids"] == first["output_ids"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_a_decode_worker_killed_mid_stream_loses_nothing(
    quantized: tuple[str, LaunchedServer],
) -> None:
    quantization, srv = quantized
    prompts, max_tokens = _prompts(6, seed=9), 96
    out: list[list[dict]] = []  # type: ignore[type-arg]
    runner = threading.Thread(
        target=lambda: out.append(asyncio.run(concurrent_greedy(srv.url, prompts, max_tokens)))
    )
    runner.start()
    deadline = time.monotonic() + 60
    victim = next(p for p in children(srv.proc.pid) if title(p) == "pdserve:decode-0")
    while time.monotonic() < deadline:  # kill once decode-0 is streaming something
        loads = {f"{w['role']}-{w['index']}": w["load"] for w in srv.health()["workers"]}
        if loads.get("decode-0", {}).get("running_requests", 0) > 0:
            break
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    runner.join(180)
    assert out, "the requests did not finish"
    # A resumed request's KV is recomputed by a prefill, which in bfloat16 rounds otherwise
    # than the decode steps that first made it: its tokens may drift from the reference
    # after the resumption point (float32 serving resumes bit for bit: test_faults.py).
    # What must hold: every stream completes, no token lost or repeated in the count, and
    # what the prefill worker made (the first token) is the reference's.
    want = _reference(quantization, prompts, max_tokens)
    for result, ids in zip(out[0], want, strict=True):
        assert result["finish_reason"] == "length", result
        assert len(result["output_ids"]) == max_tokens
        assert result["output_ids"][0] == ids[0]
