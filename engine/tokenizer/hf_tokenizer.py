"""The model's Hugging Face tokenizer, loaded without importing torch where that is exact.

``AutoTokenizer.from_pretrained`` always builds the model's config class first, which
imports torch and the model's modules: ~5 s of CPU per process on a small host, paid by
the frontend and every detokenizer shard at startup, none of which run a model. When the
files already name the generic fast tokenizer class for a model type whose tokenizer
AutoTokenizer does not replace, AutoTokenizer would return that same class loaded from
the same files, so it is loaded directly (~1 s, no torch). Anything else goes through
AutoTokenizer. tests/engine/test_hf_tokenizer.py holds the two paths equal.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

# Classes AutoTokenizer resolves to the generic tokenizers-backed class in transformers 5.
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Model types for which AutoTokenizer keeps a generic class named by the files (it swaps
# in a model-specific class for some others, e.g. qwen2 -> Qwen2Tokenizer).
GENERIC_MODEL_TYPES = frozenset({"llama", "mistral"})


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def loads_directly(model_dir: str | Path) -> bool:
    """Whether ``load_tokenizer`` can skip AutoTokenizer for this checkpoint."""
    root = Path(model_dir)
    tok_cfg = _read_json(root / "tokenizer_config.json")
    model_type = _read_json(root / "config.json").get("model_type")
    return (
        tok_cfg.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in tok_cfg
        and model_type in GENERIC_MODEL_TYPES
        and (root / "tokenizer.json").is_file()
        # With mistral-common installed, AutoTokenizer may pick its own class for
        # mistral checkpoints (those shipping tekken.json): leave the choice to it.
        and not (model_type == "mistral" and find_spec("mistral_common") is not None)
    )


# Tokenizers loaded ahead by ``preload_tokenizer``, by resolved directory: each is handed
# out once, to this process's first ``load_tokenizer`` of it (a caller may change its
# tokenizer's settings, so two never share one object).
_PRELOADED: dict[str, Any] = {}


def preload_tokenizer(model_dir: str | Path) -> Any:
    """Load ``model_dir``'s tokenizer now, for the next ``load_tokenizer`` of it here or in
    a process forked from here (the zygote's children: they then share its pages, ~45 MiB
    of vocabulary and merges for a 49k-token BPE, instead of each building its own).
    Returns it."""
    tokenizer = _PRELOADED[str(Path(model_dir).resolve())] = _load(model_dir)
    return tokenizer


def load_tokenizer(model_dir: str | Path) -> Any:
    """What ``AutoTokenizer.from_pretrained(model_dir)`` returns."""
    preloaded = _PRELOADED.pop(str(Path(model_dir).resolve()), None)
    return preloaded if preloaded is not None else _load(model_dir)


def _load(model_dir: str | Path) -> Any:
    if loads_directly(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
