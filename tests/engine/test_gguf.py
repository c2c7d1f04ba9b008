"""GGUF files convert into checkpoints that compute what their source checkpoint computes.

Each tiny random checkpoint (``bundled_models.tiny``) is written as a GGUF the way
llama.cpp's converter writes one (``gguf_files.py``: llama's Q/K permutation, Llama 3 rope
as ``rope_freqs``, padded vocabulary), converted back by ``engine.checkpoint.gguf``, and run by the
engine next to the source. F32 must give back the very same weights; F16 and Q8_0 the
source's weights as the GGUF stores them, and logits within what that storage loses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import engine.checkpoint.gguf as engine_gguf
from bundled_models import tiny
from engine.build import build_engine
from engine.checkpoint.gguf import convert_gguf
from engine.checkpoint.gguf_config import llama3_rope_from_factors
from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.kv.sequence import Sequence
from tests.engine.gguf_files import Q, llama3_rope_factors, permute, write_gguf
from wire.params import SamplingParams

PROMPTS = [[9707, 11, 1879, 0, 42], list(range(1000, 1033)), [151644, 872, 198, 9707]]
# Relative L2 error of the logits allowed per stored type. F32 loses nothing but rounding
# in rope parameters recovered from rope_freqs. The tiny models' wide random weights
# amplify storage error; measured: F16 0.15 %, Q8_0 3 %.
REL_ERR = {Q.F32: 1e-6, Q.F16: 5e-3, Q.Q8_0: 6e-2}
# llama has every type (Q/K permutation, rope_freqs); each other architecture two/one more.
CASES = [
    ("llama", Q.F32),
    ("llama", Q.F16),
    ("llama", Q.Q8_0),
    ("qwen2", Q.F32),
    ("qwen2", Q.Q8_0),
    ("qwen3", Q.F16),
]
CASE_IDS = [f"{a}-{q.name}" for a, q in CASES]
Convert = Callable[[str, Q], Path]


def _last_logits(model: Path) -> torch.Tensor:
    """(len(PROMPTS), vocab) float32 logits of each prompt's last token, from the engine."""
    runner = build_engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=16)).runner
    seqs = [Sequence(i, p, sampling=SamplingParams()) for i, p in enumerate(PROMPTS)]
    return runner.prefill([(s, s.num_tokens) for s in seqs])


@pytest.fixture(scope="module")
def convert(tmp_path_factory: pytest.TempPathFactory) -> Convert:
    """(arch, type) -> the converted directory of that tiny model's GGUF; each built once."""
    done: dict[tuple[str, Q], Path] = {}

    def get(arch: str, qtype: Q) -> Path:
        if (arch, qtype) not in done:
            tmp = tmp_path_factory.mktemp(f"{arch}-{qtype.name}")
            # The tokenizer is checked on the F32 files; the others carry a stub vocabulary.
            source, vocab = tiny.tiny_model_dir(arch), qtype == Q.F32
            path = write_gguf(source, tmp / "model.gguf", qtype, vocab=vocab)
            convert_gguf(path, tmp / "hf")
            done[arch, qtype] = tmp / "hf"
        return done[arch, qtype]

    return get


def _stored(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    """What a GGUF of ``qtype`` keeps of source tensor ``w``, back in HF layout.

    Quantized blocks run along a row, so llama's Q/K row permutation commutes with them.
    """
    if w.dim() == 1 or qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.half()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype))


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=CASE_IDS)
def test_weights_come_back_as_the_gguf_stores_them(convert: Convert, arch: str, qtype: Q) -> None:
    hf = convert(arch, qtype)
    source = load_file(str(tiny.tiny_model_dir(arch) / "model.safetensors"))
    ours = load_file(str(hf / "model.safetensors"))
    tied = json.loads((hf / "config.json").read_text())["tie_word_embeddings"]
    assert set(ours) == {n for n in source if not (tied and n == "lm_head.weight")}
    for name, w in ours.items():
        want = _stored(source[name], qtype)
        assert w.dtype == want.dtype, name
        assert torch.equal(w, want), name


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=CASE_IDS)
def test_logits_match_the_source_checkpoint(convert: Convert, arch: str, qtype: Q) -> None:
    want = _last_logits(tiny.tiny_model_dir(arch))
    got = _last_logits(convert(arch, qtype))
    assert float((got - want).norm() / want.norm()) < REL_ERR[qtype]
    if qtype != Q.Q8_0:  # a 3 % perturbation may flip a near tie
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=CASE_IDS)
def test_config_records_the_stored_dtype(convert: Convert, arch: str, qtype: Q) -> None:
    cfg = json.loads((convert(arch, qtype) / "config.json").read_text())
    assert cfg["dtype"] == ("float16" if qtype == Q.F16 else "float32")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_and_chat_template_survive(
    convert: Convert, arch: str, qwen_tokenizer: Any
) -> None:
    """Every tiny model uses the Qwen2 tokenizer (the ``qwen_tokenizer`` fixture)."""
    from transformers import AutoTokenizer

    hf, ref = convert(arch, Q.F32), qwen_tokenizer
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 151645 and gen["bos_token_id"] == 151643
    tok = AutoTokenizer.from_pretrained(hf)
    text = "Hello world, 你好世界 🎉 café 2024 <|im_start|>x"
    assert tok(text).input_ids == ref(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def test_llama_qk_permutation_is_undone() -> None:
    from engine.checkpoint.gguf import unpermute_rows

    w = torch.arange(8 * 3 * 2, dtype=torch.float32).reshape(8 * 3, 2)  # 3 heads of dim 8
    assert torch.equal(unpermute_rows(torch.from_numpy(permute(w.numpy(), 3)), 3), w)


def test_llama3_rope_is_recovered_from_rope_freqs() -> None:
    from engine.model.rope import inv_frequencies

    # Llama 3.1 8B's rope, as llama.cpp bakes it into rope_freqs.
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = {"rope_scaling": {**scaling, "rope_theta": 500000.0}, "head_dim": 128}
    factors = torch.from_numpy(llama3_rope_factors(cfg))
    got = llama3_rope_from_factors(factors, 128, 500000.0)
    assert got is not None
    for key in ("low_freq_factor", "high_freq_factor", "factor"):
        assert got[key] == pytest.approx(scaling[key], rel=1e-4)
    torch.testing.assert_close(
        inv_frequencies(128, 500000.0, got), inv_frequencies(128, 500000.0, scaling)
    )


def _bare_gguf(path: Path, arch: str, qtype: Q = Q.F32) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    if qtype == Q.F32:
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    else:  # bytes of 4 rows of 256 values in ``qtype``
        shape = gguf.quants.quant_shape_to_byte_shape((4, 256), qtype)
        w.add_tensor("token_embd.weight", np.zeros(shape, np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = _bare_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' is not supported; supported: llama"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    path = _bare_gguf(tmp_path / "m.gguf", "llama", Q.IQ2_XXS)
    with pytest.raises(
        UnsupportedModelError, match=r"IQ2_XXS are not supported; supported: .*Q8_0"
    ):
        convert_gguf(path, tmp_path / "out")


def test_a_file_that_is_no_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        convert_gguf(path, tmp_path / "out")


SUPPORTED = sorted(engine_gguf.SUPPORTED_TENSOR_TYPES, key=lambda q: q.value)


def test_every_supported_type_reads_as_gguf_reader_and_dequantize_read_it(tmp_path: Path) -> None:
    """Random bytes of every supported type, 3 rows of 512 values: our header reader and
    de-quantization give what the ``gguf`` package's own reader gives, bit for bit."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    for i, q in enumerate(SUPPORTED):  # one layer per type
        shape = gguf.quants.quant_shape_to_byte_shape((3, 512), q)
        data = rng.integers(0, 256, shape, dtype=np.uint8)
        if q in (Q.F16, Q.BF16):
            data[..., 1::2] &= 0x3F  # finite halves: exponent bits below all-ones
        w.add_tensor(f"blk.{i}.ffn_up.weight", data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = engine_gguf.GGUFCheckpoint(tmp_path / "m.gguf")
    with np.errstate(invalid="ignore", over="ignore"):  # random scales include inf and NaN
        for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors:
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            got = ours.tensor(t.name).float().numpy()
            assert got.shape == (3, 512), t.name
            assert np.array_equal(got, want, equal_nan=True), t.name
