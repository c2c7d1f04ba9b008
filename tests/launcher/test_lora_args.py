"""The LoRA flags: typed fields, and each mistake refused at startup naming its flag."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from launcher.args import parse_args
from launcher.lora_args import lora_modules
from launcher.settings import ConfigError


def test_lora_flags_land_in_typed_fields(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    c = parse_args(
        [
            "--enable-lora",
            "--lora-modules",
            f"a={tmp_path / 'a'}",
            *shlex.split("--max-loras 3 --max-lora-rank 32"),
        ]
    )
    assert (c.enable_lora, c.max_loras, c.max_lora_rank) == (True, 3, 32)
    assert lora_modules(c) == (("a", str(tmp_path / "a")),)
    assert parse_args([]).enable_lora is False


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--max-loras", "0"], "--max-loras"),
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank"),
        (["--enable-lora", "--lora-modules", "noequals"], "NAME=PATH"),
        (["--enable-lora", "--lora-modules", "a=/nonexistent/adapter"], "no adapter directory"),
    ],
)
def test_lora_flag_mistakes_are_refused_naming_the_flag(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_args(argv)


def test_more_modules_than_max_loras_is_refused(tmp_path: Path) -> None:
    for n in "abc":
        (tmp_path / n).mkdir()
    mods = [f"{n}={tmp_path / n}" for n in "abc"]
    with pytest.raises(ConfigError, match="--max-loras is 2"):
        parse_args([*shlex.split("--enable-lora --max-loras 2 --lora-modules"), *mods])
    with pytest.raises(ConfigError, match="twice"):
        parse_args(["--enable-lora", "--lora-modules", mods[0], mods[0]])
