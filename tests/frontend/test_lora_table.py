"""The LoRA adapters of a server with several frontends: one list in shared memory, so an
adapter loaded through one frontend is served through every one, an unload through any
is seen by all, ``--max-loras`` counts the server's adapters, and a restarted frontend
finds them. Two registries over one real segment (its fd's record lock included) stand
for two frontend processes."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from frontend.api.common.lora_registry import LoraRegistry
from frontend.engine_link.lora_table import LoraTable, format_table, layout_nbytes
from frontend.errors import APIError
from frontend.settings import FrontendSettings
from transport.segment import Segment

if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def adapters(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from bundled_models.lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    return [
        make_adapter(default_model_path, root / f"a{i}", 4, ("q_proj",), seed=i) for i in range(3)
    ]


@pytest.fixture
def settings(default_model_path: Path) -> FrontendSettings:
    return FrontendSettings(
        model_name="base",
        max_model_len=256,
        vocab_size=1000,
        max_loras=2,
        base_model_dir=str(default_model_path),
    )


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create("loras", layout_nbytes(2))
    format_table(seg.buf)
    yield seg
    gc.collect()  # the registries' views of it (a test's locals) are gone now
    seg.close()


def _frontend(seg: Segment, settings: FrontendSettings) -> LoraRegistry:
    return LoraRegistry(settings, LoraTable(seg.spec.fd, seg.buf))


def test_an_adapter_loaded_through_one_frontend_is_served_by_the_other(
    segment: Segment, settings: FrontendSettings, adapters: list[Path]
) -> None:
    one, two = _frontend(segment, settings), _frontend(segment, settings)
    ref = one.load("sql", str(adapters[0]))
    assert two.resolve("sql") == ref
    assert [c["id"] for c in two.cards()] == ["sql"]
    with pytest.raises(APIError, match="already loaded"):
        two.load("sql", str(adapters[1]))
    assert two.unload("sql") == ref
    assert one.resolve("sql") is None and not one.serves(ref.fingerprint)
    with pytest.raises(APIError) as gone:
        one.unload("sql")
    assert gone.value.status == 404


def test_max_loras_counts_the_servers_adapters_not_one_frontends(
    segment: Segment, settings: FrontendSettings, adapters: list[Path]
) -> None:
    one, two = _frontend(segment, settings), _frontend(segment, settings)
    one.load("a", str(adapters[0]))
    two.load("b", str(adapters[1]))
    with pytest.raises(APIError, match="--max-loras"):
        one.load("c", str(adapters[2]))
    assert sorted(one.adapters) == sorted(two.adapters) == ["a", "b"]


def test_a_restarted_frontend_finds_every_adapter_and_startup_modules_register_once(
    segment: Segment, settings: FrontendSettings, adapters: list[Path]
) -> None:
    started = replace(settings, lora_modules=(("chat", str(adapters[0])),))
    one = _frontend(segment, started)
    one.load("sql", str(adapters[1]))
    again = _frontend(segment, started)  # a second frontend, or the first one restarted
    assert list(again.adapters) == ["chat", "sql"]
    assert again.resolve("chat") == one.resolve("chat")
    # A startup adapter unloaded since stays unloaded, and --max-loras full is no failure.
    again.unload("chat")
    one.load("other", str(adapters[2]))
    assert list(_frontend(segment, started).adapters) == ["sql", "other"]
