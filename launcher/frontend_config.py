"""The frontend's ``FrontendLaunch`` (and its ``FrontendSettings``) from the server's
settings, in one place.

As ``launcher/engine_config.py`` does for the engine: every field of the two records that
``ServerConfig`` has by the same name is copied as it is, so a frontend setting added to
both (and to ``launcher/flags.py``) reaches the frontends with no line here. The fields
the launcher sets otherwise are listed in ``HTTP_SET_HERE`` and ``LAUNCH_SET_HERE``, each
with why; the others (``max_body_bytes``, ...) keep their defaults.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from frontend.settings import FrontendLaunch, FrontendSettings
from launcher import cluster
from launcher.lora_args import lora_modules
from launcher.role_args import slo_targets
from launcher.settings import ServerConfig

# FrontendSettings fields not copied from the ServerConfig field of the same name, and why.
HTTP_SET_HERE: dict[str, str] = {
    "model_name": "--served-model-name, else the checkpoint's directory or file name",
    "model_aliases": "the --model path as given, in the spellings a request may use",
    "max_model_len": "--max-model-len resolved against the checkpoint's own limit",
    "vocab_size": "the checkpoint's",
    "eos_token_ids": "the checkpoint's",
    "allowed_hosts": "a tuple: the record is frozen",
    "grammar_compile_timeout_s": "--grammar-compile-timeout",
    "max_loras": "0 unless --enable-lora",
    "lora_modules": "--lora-modules, parsed into (name, path) pairs",
    "base_model_dir": "the checkpoint resolved from --model",
}
# FrontendLaunch fields not copied from the ServerConfig field of the same name, and why.
LAUNCH_SET_HERE: dict[str, str] = {
    "model": "the checkpoint resolved from --model (a .gguf or the default, converted)",
    "http": "the FrontendSettings above",
    "connections": "the connection flags as one ConnectionLimits",
    "router_policy": "--router-policy resolved (cache-aware with prefix caching)",
    "stall_timeout_s": "--stall-timeout",
    "node": "--node-name, else the host name",
    "log_level": "the LogLevel enum's value",
    "remote_decode": "the decode indices --remote-decode reserves, not their count",
    "slo_ms": "the planner's targets, with --workers only",
}


def _same_named(record: type, config: ServerConfig, set_here: dict[str, str]) -> dict[str, Any]:
    return {
        f.name: getattr(config, f.name)
        for f in fields(record)
        if f.name not in set_here and hasattr(config, f.name)
    }


def aliases(model: Path | None) -> tuple[str, ...]:
    """Names besides the served one that requests may use: the ``--model`` path as
    ``Path`` normalises it, and a directory's also with a trailing slash (which shell
    completion leaves and ``Path`` drops)."""
    if model is None:
        return ()
    return (str(model), f"{model}/") if model.is_dir() else (str(model),)


def frontend_launch(
    config: ServerConfig, model: Path, mcfg: ModelConfig, max_model_len: int, on_cpu: bool
) -> FrontendLaunch:
    """What every frontend process of this host is started with; ``model``: the resolved
    checkpoint, ``mcfg`` its config, ``max_model_len`` the resolved limit."""
    http = FrontendSettings(
        **_same_named(FrontendSettings, config, HTTP_SET_HERE),
        model_name=config.served_model_name or model.name,
        model_aliases=aliases(config.model),
        max_model_len=max_model_len,
        vocab_size=mcfg.vocab_size,
        eos_token_ids=mcfg.eos_token_ids,
        allowed_hosts=tuple(config.allowed_hosts),
        grammar_compile_timeout_s=config.grammar_compile_timeout,
        max_loras=config.max_loras if config.enable_lora else 0,
        lora_modules=lora_modules(config),
        base_model_dir=str(model),
    )
    return FrontendLaunch(
        **_same_named(FrontendLaunch, config, LAUNCH_SET_HERE),
        model=str(model),
        http=http,
        connections=config.connection_limits,
        router_policy=config.resolved_router_policy,
        stall_timeout_s=config.stall_timeout,
        node=cluster.node_name(config),
        log_level=config.log_level.value,
        remote_decode=tuple(cluster.remote_decode(config)),
        slo_ms=slo_targets(config, "cpu" if on_cpu else "cuda") if config.workers else None,
    )
