"""A request may name the served model or one of its aliases (launch's --model path)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from frontend.api.common.context import ServingContext, check_model
from frontend.errors import ModelNotFound
from tests.frontend.conftest import MODEL, make_settings


def _ctx(**settings: Any) -> ServingContext:
    return cast(ServingContext, SimpleNamespace(settings=make_settings(**settings), loras=None))


def test_served_name_alias_and_no_name_are_accepted() -> None:
    ctx = _ctx(model_aliases=("models/SmolLM2.Q4_1.gguf",))
    for name in (MODEL, "models/SmolLM2.Q4_1.gguf", None):
        check_model(ctx, name)


def test_any_other_name_is_404_naming_the_served_one() -> None:
    with pytest.raises(ModelNotFound, match=f"this server serves '{MODEL}'"):
        check_model(_ctx(model_aliases=("a.gguf",)), "gpt-4")
