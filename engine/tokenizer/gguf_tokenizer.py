"""A GGUF file's tokenizer as Hugging Face tokenizer files (tokenizer.json + config).

A GGUF carries its vocabulary, merges, special token ids and chat template as metadata.
transformers rebuilds a fast tokenizer from those (``from_pretrained(..., gguf_file=...)``);
this module saves it next to the converted weights, so that every pdserve process loads the
tokenizer as it loads any checkpoint directory's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import UnsupportedModelError

# tokenizer.ggml.model values that transformers converts: byte-level BPE (GPT-2 style:
# Llama 3, Qwen2/3, SmolLM) and sentencepiece (Llama 2, Mistral).
SUPPORTED_TOKENIZERS = ("gpt2", "llama")


def check_tokenizer(model: str | None) -> None:
    if model not in SUPPORTED_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF tokenizer {model!r} is not supported; supported: {', '.join(SUPPORTED_TOKENIZERS)}"
        )


def save_tokenizer(gguf_path: Path, out: Path, model_type: str, max_model_len: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into ``out``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    where: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    # NOTE: naming the model type spares AutoTokenizer parsing the whole file a second time
    # (tens of seconds for a 152k vocabulary) only to learn it. A type with a tokenizer
    # class of its own gets it (Qwen2's adds its NFC normaliser); others, as for Llama,
    # the generic fast tokenizer transformers builds from the GGUF.
    if model_type in TOKENIZER_MAPPING_NAMES:
        tok = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), tokenizer_type=model_type, **where
        )
    else:
        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), **where)
    tok.model_max_length = max_model_len
    tok.save_pretrained(str(out))
