"""``load_tokenizer`` is AutoTokenizer: the same class and the same behaviour, without
importing torch where the checkpoint's files allow it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bundled_models import tiny
from bundled_models.default_model import default_model_dir
from engine.tokenizer.hf_tokenizer import GENERIC_MODEL_TYPES, load_tokenizer, loads_directly

_TEXTS = [
    "What is the capital of France?",
    "  leading spaces\tand tabs\n\nnewlines",
    "émigré naïve 北京 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def _same(a: object, b: object) -> None:
    from transformers import PreTrainedTokenizerBase

    assert isinstance(a, PreTrainedTokenizerBase) and isinstance(b, PreTrainedTokenizerBase)
    assert type(a) is type(b)
    assert a.all_special_ids == b.all_special_ids and len(a) == len(b)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    for text in _TEXTS:
        ids = a.encode(text)
        assert ids == b.encode(text)
        for skip in (True, False):
            assert a.decode(ids, skip_special_tokens=skip) == b.decode(
                ids, skip_special_tokens=skip
            )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    if a.chat_template is not None:
        kw = {"tokenize": False, "add_generation_prompt": True}
        assert a.apply_chat_template(messages, **kw) == b.apply_chat_template(messages, **kw)
    assert a.chat_template == b.chat_template


def test_default_model_loads_directly_and_equals_autotokenizer() -> None:
    from transformers import AutoTokenizer

    path = default_model_dir()
    assert loads_directly(path)
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_other_checkpoints_equal_autotokenizer(arch: str) -> None:
    from transformers import AutoTokenizer

    path = tiny.tiny_model_dir(arch)
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_direct_path_rests_on_what_autotokenizer_does() -> None:
    """The direct path assumes AutoTokenizer keeps the generic class the files name for
    these model types; a transformers release that changes that must fail here."""
    from transformers.models.auto import tokenization_auto as auto

    for model_type in GENERIC_MODEL_TYPES:
        assert model_type not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend")


def test_qwen2_goes_through_autotokenizer() -> None:
    """The tiny qwen2 checkpoint's files name the generic class, yet AutoTokenizer returns
    Qwen2Tokenizer for that model type: the direct path must not be taken."""
    from transformers import AutoTokenizer

    path = tiny.tiny_model_dir("qwen2")
    assert '"TokenizersBackend"' in (path / "tokenizer_config.json").read_text()
    assert not loads_directly(path)
    assert type(load_tokenizer(path)).__name__ == "Qwen2Tokenizer"
    assert type(AutoTokenizer.from_pretrained(path)).__name__ == "Qwen2Tokenizer"


def test_frontend_and_detokenizer_do_not_import_torch() -> None:
    """The frontend and the detokenizer shards run no model: torch would cost each of
    them seconds of CPU at startup, beside the workers that need it. (The frontend's
    grammar worker processes import it, with xgrammar: ``grammar_worker.py``.)"""
    code = (
        "import sys\n"
        "import frontend.http.server, detokenizer.worker\n"
        "from engine.tokenizer.hf_tokenizer import load_tokenizer\n"
        f"load_tokenizer({str(default_model_dir())!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_preloaded_tokenizer_is_handed_out_once_then_loaded_afresh() -> None:
    from engine.tokenizer.hf_tokenizer import preload_tokenizer

    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    preloaded = preload_tokenizer(model)
    first = load_tokenizer(str(model) + "/")  # the same directory, spelled otherwise
    second = load_tokenizer(model)
    assert first is preloaded and second is not preloaded  # to the first caller only
    _same(first, second)
