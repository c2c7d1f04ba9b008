"""``launch`` on an NVIDIA GPU: both KV backends and co-located, greedy output == transformers.

Skipped without CUDA (this repository's CI has no GPU). Every server shares GPU 0 between
its workers (``--prefill-gpus 0 --decode-gpus 0``) so that one GPU is enough; with
cuda_ipc a killed decode worker and then a killed prefill worker must be replaced and
serve exactly again: the pool handle is re-sent to the new decode process, and the new
prefill pool is mapped in place of the dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import LaunchedServer
from tests.e2e.helpers import children, concurrent_greedy, title

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
COMMON = shlex.split(
    "--device cuda --dtype float32 --gpu-memory-utilization 0.3 --kv-cache-tokens 8192 --max-model-len 1024 --max-num-seqs 32"
)
ON_GPU0 = shlex.split("--prefill 1 --decode 1 --prefill-gpus 0 --decode-gpus 0")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts_and_reference(default_model_path: Path) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 150_000, (1 + 13 * i,), generator=g).tolist() for i in range(8)]
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).cuda()
    want = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
        want.append(out[0, len(p) :].tolist())
    del hf
    torch.cuda.empty_cache()
    return prompts, want


@contextlib.contextmanager
def _serve(args: list[str]) -> Iterator[LaunchedServer]:
    srv = LaunchedServer([*args, *COMMON])
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
    assert code == 0


def _check(srv: LaunchedServer, ref: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, want = ref
    results = asyncio.run(concurrent_greedy(srv.url, prompts, MAX_TOKENS))
    assert [r["output_ids"] for r in results] == want, "".join(srv.log[-30:])
    # Top logprobs leave the GPU in the sample; the greedy token is among the top 3.
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(len(top) == 3 for top in lp["top_logprobs"])
    assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))


def _kill_and_wait(srv: LaunchedServer, name: str) -> None:
    pid = next(p for p in children(srv.proc.pid) if title(p) == name)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            workers = srv.health()["workers"]
        except httpx.HTTPError:
            continue
        if all(w["alive"] for w in workers) and pid not in [w["pid"] for w in workers]:
            return
    raise AssertionError(f"{name} not back:\n" + "".join(srv.log[-30:]))


def test_cuda_ipc_on_one_shared_gpu_survives_worker_restarts(
    default_model_path: Path, prompts_and_reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    with _serve([*ON_GPU0, "--kv-transfer", "cuda_ipc"]) as srv:
        _check(srv, prompts_and_reference)
        assert any("on GPUs:" in line and "cuda_ipc" in line for line in srv.log)
        for name in ("pdserve:decode-0", "pdserve:prefill-0"):
            _kill_and_wait(srv, name)
            _check(srv, prompts_and_reference)


@pytest.mark.parametrize("args", [[*ON_GPU0, "--kv-transfer", "shm"], ["--colocated", "1"]])
def test_shm_staging_and_colocated_on_cuda(
    args: list[str], prompts_and_reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    with _serve(args) as srv:
        _check(srv, prompts_and_reference)
