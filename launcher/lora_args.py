"""The LoRA flags (docs/lora.md), kept apart from ``launcher/args.py``'s long
table: ``--enable-lora``, ``--lora-modules name=path ...``, ``--max-loras`` (adapters
registered, and resident per worker) and ``--max-lora-rank``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Protocol

DEFAULTS: dict[str, Any] = {
    "enable_lora": False,
    "lora_modules": (),
    "max_loras": 4,
    "max_lora_rank": 16,
}


class LoraFlags(Protocol):
    """The LoRA fields of ``ServerConfig`` (read only)."""

    @property
    def enable_lora(self) -> bool: ...
    @property
    def lora_modules(self) -> tuple[str, ...]: ...
    @property
    def max_loras(self) -> int: ...
    @property
    def max_lora_rank(self) -> int: ...


def add_lora_flags(p: argparse._ActionsContainer) -> None:
    add = p.add_argument
    add(
        "--enable-lora",
        action="store_true",
        default=DEFAULTS["enable_lora"],
        help="serve LoRA adapters on the base model: a request names one as its 'model'",
    )
    add(
        "--lora-modules",
        nargs="+",
        type=str,
        default=DEFAULTS["lora_modules"],
        metavar="NAME=PATH",
        help="adapters to serve from the start: a name and a PEFT directory each "
        "(adapter_config.json + adapter_model.safetensors); more come with "
        "POST /v1/load_lora_adapter",
    )
    add(
        "--max-loras",
        type=int,
        default=DEFAULTS["max_loras"],
        help="adapters served at once: registered in the frontend, and resident in each "
        "worker (their weights are held for all of them)",
    )
    add(
        "--max-lora-rank",
        type=int,
        default=DEFAULTS["max_lora_rank"],
        help="largest adapter rank accepted; a higher one is refused with a 400",
    )


def lora_modules(c: LoraFlags) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` as (name, path) pairs (validated first)."""
    return tuple((m.partition("=")[0], m.partition("=")[2]) for m in c.lora_modules)


def validate_lora_flags(c: LoraFlags) -> str | None:
    """What is wrong with the LoRA flags, naming the flag; None if nothing."""
    if not c.enable_lora:
        if c.lora_modules:
            return "--lora-modules needs --enable-lora"
        return None
    if not 1 <= c.max_loras <= 64:
        return f"--max-loras must be in [1, 64], not {c.max_loras}"
    if not 1 <= c.max_lora_rank <= 512:
        return f"--max-lora-rank must be in [1, 512], not {c.max_lora_rank}"
    names: set[str] = set()
    for m in c.lora_modules:
        name, sep, path = m.partition("=")
        if not sep or not name or not path:
            return f"--lora-modules {m!r}: expected NAME=PATH"
        if name in names:
            return f"--lora-modules names {name!r} twice"
        if not Path(path).is_dir():
            return f"--lora-modules {name}: no adapter directory at {path}"
        names.add(name)
    if len(names) > c.max_loras:
        return f"--lora-modules gives {len(names)} adapters; --max-loras is {c.max_loras}"
    return None
