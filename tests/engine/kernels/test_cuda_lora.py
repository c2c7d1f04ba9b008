"""LoRA on a real GPU through the CUDA path (Triton kernels, decode CUDA graphs): a batch
of three adapters and the base generates what transformers + peft generate for each
alone, and bfloat16 agrees with the torch path. Skipped without CUDA (the CPU tests run
the same kernels under the interpreter, except graph capture and compiled kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig
from engine.cuda.lora_bank import StackedLoraBank
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from tests.e2e.helpers import hf_greedy
from wire.params import LoraRef, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = {  # name -> (rank, targets)
    "qvd8": (8, ("q_proj", "v_proj", "down_proj")),
    "all16": (16, ALL),
    "kogu16": (16, ("k_proj", "o_proj", "gate_proj", "up_proj")),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, LoraRef]:
    pytest.importorskip("peft")
    from bundled_models.lora import make_adapter_refs

    return make_adapter_refs(default_model_path, tmp_path_factory.mktemp("lora"), KINDS)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 30, 17, 5)]


def test_mixed_adapters_and_base_on_the_cuda_path_match_transformers_peft(
    default_model_path: Path, adapters: dict[str, LoraRef]
) -> None:
    from transformers import AutoModelForCausalLM

    from bundled_models.lora import peft_model

    refs = [adapters["qvd8"], None, adapters["all16"], adapters["kogu16"]]
    llm = LLM(
        EngineConfig(
            model=str(default_model_path),
            device="cuda",
            dtype="float32",
            num_kv_blocks=64,
            max_num_seqs=8,
            max_loras=4,
        )
    )
    path = llm.runner._kernels
    assert path is not None and path.lora_graphs is not None, "not on the CUDA kernel path"
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora=r)
        for r in refs
    ]
    got = [r.output_ids for r in llm.generate(_prompts(), params)]
    assert path.lora_graphs.captured, "the mixed batch's decode steps ran no LoRA graph"
    for prompt, ref, ids in zip(_prompts(), refs, got, strict=True):
        if ref is None:
            model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
        else:
            model = peft_model(default_model_path, Path(ref.path))
        assert ids == hf_greedy(model, prompt, MAX_TOKENS), ref
    # A batch of base rows replays the plain graphs, which hold no LoRA launches.
    assert path.graphs is not None
    before = list(path.graphs.captured)
    llm.generate(_prompts()[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert path.graphs.captured != before


def _logits(runner: ModelRunner, refs: list[LoraRef | None]) -> list[torch.Tensor]:
    seqs = [
        Sequence(i, p, sampling=SamplingParams(lora=r))
        for i, (p, r) in enumerate(zip(_prompts(), refs))
    ]
    out = [runner.prefill([(s, s.num_tokens) for s in seqs]).float().cpu()]
    for step in range(4):
        for s in seqs:
            s.output_ids.append(500 + step)
        out.append(runner.decode(seqs).float().cpu())
    return out


def test_bfloat16_graphs_with_adapters_agree_with_the_torch_path(
    default_model_path: Path, adapters: dict[str, LoraRef]
) -> None:
    refs = [adapters["all16"], None, adapters["qvd8"], adapters["all16"]]

    def runner(backend: str) -> ModelRunner:
        return build_engine(
            EngineConfig(
                model=str(default_model_path),
                device="cuda",
                dtype="bfloat16",
                num_kv_blocks=64,
                max_num_seqs=8,
                max_loras=2,
                attention_backend=backend,
            )
        ).runner

    kernel = runner("auto")
    assert kernel.loras is not None
    assert all(isinstance(lin.lora, StackedLoraBank) for lin, _ in kernel.loras._linears())
    for got, want in zip(_logits(kernel, refs), _logits(runner("torch"), refs), strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
