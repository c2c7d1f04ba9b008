"""LoRA adapters on SmolLM2-135M-Instruct through a 1P1D server: each adapter's greedy
output equals transformers + peft's on the same float32 weights (--quantization none)."""

from __future__ import annotations

import importlib.util
import shlex
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bundled_models.default_model import default_model_dir
from bundled_models.lora import make_adapter, peft_model
from tests.conftest import LaunchedServer
from tests.e2e.helpers import hf_greedy

# Not imported here: peft imports triton, and triton imported outside the Triton
# interpreter breaks the kernel tests that the same session runs later.
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)
pytestmark = pytest.mark.slow

MAX_TOKENS = 24
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = {"qv8": (8, ("q_proj", "v_proj")), "all16": (16, ALL)}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-adapters")
    return {
        name: make_adapter(default_model_dir(), root / name, rank, targets, seed=i + 1)
        for i, (name, (rank, targets)) in enumerate(KINDS.items())
    }


@pytest.fixture(scope="module")
def smol(adapters: dict[str, Path]) -> Iterator[LaunchedServer]:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    yield from LaunchedServer.serving(
        [
            "--model",
            str(default_model_dir()),
            *shlex.split(
                "--prefill 1 --decode 1 --device cpu --quantization none --enable-lora --max-loras 2 --lora-modules"
            ),
            *modules,
        ],
        tiny_model=False,
    )


def test_greedy_output_per_adapter_equals_transformers_peft(
    smol: LaunchedServer, adapters: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    seen: dict[str, list[list[int]]] = {}
    for name, path in adapters.items():
        ref = peft_model(default_model_dir(), path)
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            want = hf_greedy(ref, ids, MAX_TOKENS)
            body = {
                "model": name,
                "prompt": ids,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            r = httpx.post(smol.url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want, (name, prompt)
            seen.setdefault(name, []).append(want)
    assert seen["qv8"] != seen["all16"], "the adapters changed nothing"
