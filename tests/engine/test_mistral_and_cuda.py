"""Mistral checkpoints run like the other Llama-family ones; the CUDA path matches CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bundled_models.tiny import TINY_SIZES
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from wire.params import SamplingParams


def _tiny_mistral(root: Path) -> Path:
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        vocab_size=1000,
        **TINY_SIZES,
        max_position_embeddings=8192,
        sliding_window=1024,
        eos_token_id=2,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(root / "mistral")
    return root / "mistral"


def test_mistral_logits_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = _tiny_mistral(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = build_engine(EngineConfig(model=str(path), num_kv_blocks=16)).runner
    # Attention is always full here, so the context stops at the sliding window.
    assert runner.max_model_len == 1024
    assert runner.model_config.eos_token_ids == (2,)
    ids = torch.randint(0, 1000, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    seq = Sequence(0, ids[:40], sampling=SamplingParams())
    torch.testing.assert_close(runner.prefill([(seq, 40)])[0], ref[39], atol=1e-4, rtol=0)
    for pos in range(40, 45):
        seq.output_ids.append(ids[pos])
        torch.testing.assert_close(runner.decode([seq])[0], ref[pos], atol=1e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_runner_matches_cpu_runner(default_model_path: Path) -> None:
    prompts = [list(range(100, 100 + n)) for n in (1, 17, 50)]
    logits = {}
    for device in ("cpu", "cuda"):
        runner = build_engine(EngineConfig(model=str(default_model_path), device=device)).runner
        seqs = [Sequence(i, p) for i, p in enumerate(prompts)]
        first = runner.prefill([(s, s.num_tokens) for s in seqs]).cpu()
        for s in seqs:
            s.output_ids.append(7)
        logits[device] = (first, runner.decode(seqs).cpu())
    for cpu, cuda in zip(logits["cpu"], logits["cuda"]):
        torch.testing.assert_close(cuda, cpu, atol=1e-3, rtol=1e-3)
