"""Session-wide fixtures: the Qwen2-vocabulary tokenizer and the tiny checkpoints.

They are built offline on first use and cached (see ``pdserve.tiny_models``), so the
suite needs no network and pays the build cost once per machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve import tiny_models


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    return tiny_models.tokenizer_dir()


@pytest.fixture(scope="session")
def qwen_tokenizer(tokenizer_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


@pytest.fixture(scope="session", params=tiny_models.ARCHITECTURES)
def tiny_model_path(request: pytest.FixtureRequest) -> Path:
    """Each tiny architecture in turn (llama, qwen2, qwen3)."""
    return tiny_models.tiny_model_dir(request.param)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return tiny_models.tiny_model_dir(tiny_models.DEFAULT_ARCH)
