"""The embedded default model is SmolLM2-135M-Instruct, converted from its GGUF, and it
computes what transformers computes from the same GGUF.

transformers' GGUF loader is an independent reader of the same file (its own tensor-name
map, its own Q/K un-permutation; de-quantization is the ``gguf`` package's for both), so
equal weights and logits pin the whole conversion on a real quantized model (Q4_1 + Q8_0).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from bundled_models.default_model import (
    DEFAULT_MODEL_NAME,
    bundled_gguf,
    default_model_dir,
    gguf_model_dir,
    resolve_model,
)
from bundled_models.tiny import tiny_model_dir
from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.weights.linear import Linear
from wire.params import SamplingParams

TEXTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]
DECODE_STEPS = 3


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares two cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' own reading of the GGUF: de-quantized to float32."""
    from transformers import AutoModelForCausalLM

    path = bundled_gguf()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_default_model_is_smollm2_and_cached(model_dir: Path) -> None:
    assert model_dir.name == DEFAULT_MODEL_NAME  # the name launch serves it under
    assert resolve_model(None) == model_dir
    assert (model_dir / ".complete").exists()


@pytest.mark.slow  # transformers' GGUF loader takes ~30 s to read this file on 2 busy cores
def test_converted_weights_equal_what_transformers_reads(model_dir: Path, reference: Any) -> None:
    ours = load_file(str(model_dir / "model.safetensors"))
    theirs = reference.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name


@pytest.mark.slow
def test_engine_logits_match_transformers_on_the_gguf(
    model_dir: Path, reference: Any, tokenizer: Any
) -> None:
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    # float32 serving is the exactness reference; the default packs the GGUF's blocks.
    runner = build_engine(
        EngineConfig(model=str(model_dir), num_kv_blocks=32, quantization="none")
    ).runner
    seqs = [Sequence(i, p, sampling=SamplingParams()) for i, p in enumerate(prompts)]
    got = runner.prefill([(s, s.num_tokens) for s in seqs])
    for step in range(DECODE_STEPS + 1):
        with torch.no_grad():
            want = torch.stack(
                [reference(torch.tensor([s.all_ids])).logits[0, -1] for s in seqs]
            )  # (len(TEXTS), vocab)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        if step == DECODE_STEPS:
            break
        for s, token in zip(seqs, want.argmax(-1).tolist()):
            s.output_ids.append(token)
        got = runner.decode(seqs)


def test_default_model_serves_its_q4_1_blocks_packed(model_dir: Path) -> None:
    runner = build_engine(EngineConfig(model=str(model_dir), num_kv_blocks=8)).runner
    assert runner.quantization == "gguf"
    kinds = {m.kind for m in runner.model.modules() if isinstance(m, Linear)}
    assert kinds == {"int4", "int8"}  # Q4_1 blocks; the Q8_0 embedding as the tied head
    assert runner.model.lm_head.kind == "int8"


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_default_model_answers_a_question(
    model_dir: Path, tokenizer: Any, quantization: str
) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    llm = LLM(EngineConfig(model=str(model_dir), num_kv_blocks=32, quantization=quantization))
    [result] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16))
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert "Paris" in text, text


def test_a_gguf_is_converted_once_per_path_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.engine.gguf_files import write_gguf

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_dir("qwen2"), tmp_path / "tiny.gguf", vocab=False)
    first = resolve_model(path)
    assert first.name == "tiny" and (first / "config.json").exists()
    assert gguf_model_dir(path) == first  # cached
    os.utime(path, ns=(0, 0))  # a replaced file is converted again
    second = gguf_model_dir(path)
    assert second != first and (second / "model.safetensors").exists()
