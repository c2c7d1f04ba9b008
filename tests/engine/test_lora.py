"""LoRA adapters in the engine: the same logits as transformers + peft, several adapters
and the base in one batch, packed base weights under adapters, a bounded resident set,
prefix blocks that never cross adapters, and adapters that are refused by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from bundled_models import tiny
from bundled_models.lora import lora_ref, make_adapter, peft_model
from colocated.llm import LLM
from engine.build import build_engine
from engine.checkpoint.lora_loader import LoraCapacityError
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.weights.lora_spec import LoraError, read_lora
from engine.weights.quant import quantize_int4, quantize_int8
from wire.params import LoraRef, SamplingParams

# Not imported here: peft imports triton, and triton imported outside the Triton
# interpreter breaks the kernel tests that the same session runs later.
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)

# Built (once, cached) on import: a test of this file may be the first to need it.
TINY_LLAMA = tiny.tiny_model_dir("llama")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, targets, extra LoraConfig fields) of the adapters every test uses.
KINDS: dict[str, tuple[int, tuple[str, ...], dict[str, Any]]] = {
    "qvd8": (8, ("q_proj", "v_proj", "down_proj"), {}),
    "all16": (16, ALL, {}),
    "kogu16rs": (16, ("k_proj", "o_proj", "gate_proj", "up_proj"), {"use_rslora": True}),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Path, str], Path]:
    """Adapters by (base, kind), made on first use."""
    root = tmp_path_factory.mktemp("lora")

    class Made(dict):
        def __missing__(self, key: tuple[Path, str]) -> Path:
            base, kind = key
            rank, targets, extra = KINDS[kind]
            out = root / f"{base.name}-{kind}"
            self[key] = make_adapter(base, out, rank, targets, seed=len(self) + 1, **extra)
            return self[key]

    return Made()


def _runner(base: Path, quantization: str = "none", max_loras: int = 4) -> ModelRunner:
    return build_engine(
        EngineConfig(
            model=str(base), num_kv_blocks=128, max_loras=max_loras, quantization=quantization
        )
    ).runner


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 150_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_logits(
    runner: ModelRunner, prompt: list[int], then: list[int], lora: LoraRef | None
) -> torch.Tensor:
    """Logits after the prompt (prefill), then after each of ``then`` (decode): (1 + len(then), V)."""
    s = Sequence(0, prompt, sampling=SamplingParams(lora=lora))
    rows = [runner.prefill([(s, s.num_tokens)])[0]]
    for t in then:
        s.output_ids.append(t)
        rows.append(runner.decode([s])[0])
    runner.kv.free_blocks(s)
    return torch.stack(rows)


@pytest.mark.parametrize("kind", list(KINDS))
def test_adapter_logits_match_transformers_peft(
    tiny_model_path: Path, adapters: dict[tuple[Path, str], Path], kind: str
) -> None:
    path = adapters[(tiny_model_path, kind)]
    ref_model = peft_model(tiny_model_path, path)
    full = _tokens(45, seed=3)
    with torch.no_grad():
        want = ref_model(torch.tensor([full])).logits[0, 39:]  # (6, V)
    runner = _runner(tiny_model_path)
    got = _engine_logits(runner, full[:40], full[40:45], lora_ref(path))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    base = _engine_logits(runner, full[:40], full[40:45], None)
    assert (base - want).abs().max() > 1e-2, "the adapter changed nothing: the test is blind"


def test_greedy_generation_matches_peft_generate(adapters: dict[tuple[Path, str], Path]) -> None:
    llm = LLM(EngineConfig(model=str(TINY_LLAMA), num_kv_blocks=64, max_loras=2))
    prompt = _tokens(11, seed=5)
    for kind in ("qvd8", "all16"):
        path = adapters[(TINY_LLAMA, kind)]
        params = SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, lora=lora_ref(path)
        )
        (result,) = llm.generate([prompt], params)
        with torch.no_grad():
            out = peft_model(TINY_LLAMA, path).generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert result.output_ids == out[0, len(prompt) :].tolist(), kind


def test_a_batch_of_three_adapters_and_the_base_gives_each_row_what_it_gets_alone(
    adapters: dict[tuple[Path, str], Path],
) -> None:
    runner = _runner(TINY_LLAMA)
    refs = [lora_ref(adapters[(TINY_LLAMA, k)], k) for k in KINDS] + [None]
    prompts = [_tokens(n, seed=10 + n) for n in (17, 33, 9, 40)]
    alone = [_engine_logits(runner, p, [5, 6, 7], r) for p, r in zip(prompts, refs)]
    seqs = [
        Sequence(i, p, sampling=SamplingParams(lora=r))
        for i, (p, r) in enumerate(zip(prompts, refs))
    ]
    rows = [runner.prefill([(s, s.num_tokens) for s in seqs])]
    for t in (5, 6, 7):
        for s in seqs:
            s.output_ids.append(t)
        rows.append(runner.decode(seqs))
    batched = torch.stack(rows, dim=1)  # (4 requests, 4 steps, V)
    # NOTE: not bit for bit: the base model alone already differs in its last bits
    # between a row run alone and in a batch (float32 GEMMs and SDPA block by row count),
    # the base's row here included; an adapter adds no more than that.
    for i, want in enumerate(alone):
        torch.testing.assert_close(batched[i], want, atol=1e-4, rtol=0, msg=f"request {i}")
        assert torch.equal(batched[i].argmax(-1), want.argmax(-1))


def _dequantized_reference(base: Path, adapter: Path) -> Any:
    """transformers + peft on ``base`` with the weights ``--quantization int4`` serves:
    the body int4, the embedding and head int8, each exactly de-quantized."""
    model = peft_model(base, adapter)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or p.dim() != 2:
                continue
            body = "layers." in name
            rows = quantize_int4(p.float()) if body else quantize_int8(p.float())
            p.copy_(rows.dequantize())
    return model


def test_packed_int4_base_weights_keep_working_under_adapters(
    adapters: dict[tuple[Path, str], Path],
) -> None:
    path = adapters[(TINY_LLAMA, "all16")]
    full = _tokens(30, seed=7)
    runner = _runner(TINY_LLAMA, quantization="int4")
    assert runner.model.layer(0).attn.qkv.kind == "int4"
    ref_lora = _dequantized_reference(TINY_LLAMA, path)
    with torch.no_grad():
        want = ref_lora(torch.tensor([full])).logits[0, 24:]
        with ref_lora.disable_adapter():
            want_base = ref_lora(torch.tensor([full])).logits[0, 24:]
    got = _engine_logits(runner, full[:25], full[25:30], lora_ref(path))
    got_base = _engine_logits(runner, full[:25], full[25:30], None)
    # Packed layers compute in bfloat16: the base's own error bounds the adapter's.
    base_err = (got_base - want_base).abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 3 * base_err + 1e-3, (err, base_err)
    assert (want - want_base).abs().max() > 10 * max(err, 1e-3), "the adapter changed nothing"


def test_resident_adapters_are_bounded_and_least_recently_used_go_first(
    adapters: dict[tuple[Path, str], Path],
) -> None:
    runner = _runner(TINY_LLAMA, max_loras=2)
    assert runner.loras is not None
    refs = [lora_ref(adapters[(TINY_LLAMA, k)], k) for k in KINDS]
    prompt = _tokens(8, seed=1)
    first = _engine_logits(runner, prompt, [], refs[0])
    for r in refs[1:]:
        _engine_logits(runner, prompt, [], r)
    assert runner.loras.resident == [refs[1].fingerprint, refs[2].fingerprint]
    # Evicted and loaded again: the same numbers.
    assert torch.equal(_engine_logits(runner, prompt, [], refs[0]), first)
    # A step of three adapters runs in turns; a turn may not need more than the slots.
    with pytest.raises(LoraCapacityError, match="--max-loras is 2"):
        runner.loras.batch(refs)
    assert runner.loras.unload(refs[0].fingerprint)
    assert len(runner.loras.resident) == 1


def test_a_prompt_under_another_adapter_reuses_no_cached_block(
    adapters: dict[tuple[Path, str], Path],
) -> None:
    runner = _runner(TINY_LLAMA)
    a, b = (lora_ref(adapters[(TINY_LLAMA, k)], k) for k in ("qvd8", "all16"))
    prompt = _tokens(64, seed=2)

    def cached(lora: LoraRef | None) -> int:
        s = Sequence(0, prompt, sampling=SamplingParams(lora=lora))
        hit = runner.kv.reuse_prefix(s)
        runner.prefill([(s, s.num_uncomputed_tokens)])
        runner.kv.free_blocks(s)
        return hit

    assert cached(a) == 0
    assert cached(b) == 0  # same tokens, another adapter: nothing shared
    assert cached(None) == 0  # nor with the base
    assert cached(a) == 48 and cached(b) == 48 and cached(None) == 48


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_adapters_the_math_would_not_serve_are_refused_by_name(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    path = make_adapter(TINY_LLAMA, tmp_path / "x", 4, ("q_proj",), seed=0, **extra)
    with pytest.raises(LoraError, match=message):
        read_lora(path)


def test_unfit_or_missing_adapters_are_refused_by_name(
    tmp_path: Path, adapters: dict[tuple[Path, str], Path]
) -> None:
    runner = _runner(TINY_LLAMA, max_loras=1)
    emb = make_adapter(TINY_LLAMA, tmp_path / "emb", 4, ("embed_tokens",), seed=0)
    with pytest.raises(LoraError, match="embed_tokens"):
        read_lora(emb)
    with pytest.raises(LoraError, match="no such adapter"):
        read_lora(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="not a LoRA adapter"):
        read_lora(tmp_path / "empty")
    big = adapters[(TINY_LLAMA, "all16")]
    small = _runner(TINY_LLAMA, max_loras=1)
    small.loras.max_rank = 8  # type: ignore[union-attr]
    with pytest.raises(LoraError, match="rank 16 exceeds --max-lora-rank 8"):
        _engine_logits(small, [1, 2, 3], [], lora_ref(big))
    qwen = tiny.tiny_model_dir("qwen3")
    other = make_adapter(qwen, tmp_path / "other", 4, ("q_proj",), seed=0)  # q: 128 wide
    with pytest.raises(LoraError, match="shape"):
        _engine_logits(runner, [1, 2, 3], [], lora_ref(other))
    assert runner.loras is not None and runner.loras.resident == []
    # The runner serves on after each refusal.
    _engine_logits(runner, [1, 2, 3], [4], lora_ref(adapters[(TINY_LLAMA, "qvd8")]))


def test_more_adapters_in_flight_than_slots_are_served_in_turns(
    adapters: dict[tuple[Path, str], Path],
) -> None:
    runner = _runner(TINY_LLAMA, max_loras=2)
    refs = [lora_ref(adapters[(TINY_LLAMA, k)], k) for k in KINDS] + [None]
    prompts = [_tokens(n, seed=40 + n) for n in (12, 20, 7, 30)]
    alone = [_engine_logits(runner, p, [9, 8], r) for p, r in zip(prompts, refs)]
    seqs = [
        Sequence(i, p, sampling=SamplingParams(lora=r))
        for i, (p, r) in enumerate(zip(prompts, refs))
    ]
    rows = [runner.prefill([(s, s.num_tokens) for s in seqs])]
    for t in (9, 8):
        for s in seqs:
            s.output_ids.append(t)
        rows.append(runner.decode(seqs))
    batched = torch.stack(rows, dim=1)  # (4 requests, 3 steps, V): in the batch's order
    for i, want in enumerate(alone):
        torch.testing.assert_close(batched[i], want, atol=1e-4, rtol=0, msg=f"request {i}")


def test_a_retired_adapter_frees_its_memory_at_once_and_stays_out_once_unused(
    adapters: dict[tuple[Path, str], Path],
) -> None:
    runner = _runner(TINY_LLAMA, max_loras=2)
    loras = runner.loras
    assert loras is not None and loras.nbytes == 0
    a, b = (lora_ref(adapters[(TINY_LLAMA, k)], k) for k in ("all16", "qvd8"))
    prompt = _tokens(10, seed=6)
    # A request under ``a`` is in flight when the frontend unloads it.
    s = Sequence(0, prompt, sampling=SamplingParams(lora=a))
    runner.prefill([(s, s.num_tokens)])
    assert loras.resident == [a.fingerprint] and loras.nbytes > 0
    assert loras.retire(a.fingerprint)
    assert loras.resident == [] and loras.nbytes == 0  # memory back where it was
    s.output_ids.append(5)
    runner.decode([s])  # the request in flight loads it again to finish
    assert loras.resident == [a.fingerprint]
    runner.kv.free_blocks(s)
    _engine_logits(runner, prompt, [], None)  # the first step without it evicts it
    assert loras.resident == [] and loras.nbytes == 0
    _engine_logits(runner, prompt, [], b)
    assert loras.resident == [b.fingerprint]
    # Registered again: a new request's arrival check lifts the retirement.
    loras.check(a)
    _engine_logits(runner, prompt, [], a)
    _engine_logits(runner, prompt, [], None)
    assert loras.resident == [b.fingerprint, a.fingerprint]
