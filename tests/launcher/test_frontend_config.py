"""The frontend's settings come from the server's in one place: every field both have by
name is copied, the rest are set from the checkpoint and the resolved flags."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from engine.config import ModelConfig
from frontend.settings import FrontendLaunch, FrontendSettings
from launcher.frontend_config import HTTP_SET_HERE, LAUNCH_SET_HERE, frontend_launch
from launcher.settings import ServerConfig

# Settings away from their defaults, each one that the frontend takes by the same name.
CHANGED = {
    "api_key": "secret",
    "metrics_no_auth": True,
    "deterministic": True,
    "max_json_depth": 7,
    "grammar_workers": 3,
    "max_lora_rank": 8,
    "port": 18123,
    "max_waiting_requests": 5,
    "max_request_retries": 4,
    "api_workers": 2,
    "allow_role_override": True,
}


def test_every_setting_of_the_same_name_reaches_the_frontend(default_model_path: Path) -> None:
    config = replace(ServerConfig(), **CHANGED)  # type: ignore[arg-type]
    mcfg = ModelConfig.from_pretrained(default_model_path)
    launch = frontend_launch(config, default_model_path, mcfg, 512, on_cpu=True)
    copied: set[str] = set()
    for record, got, set_here in (
        (FrontendSettings, launch.http, HTTP_SET_HERE),
        (FrontendLaunch, launch, LAUNCH_SET_HERE),
    ):
        assert set(set_here) <= {f.name for f in fields(record)}  # no stale exception
        names = [f.name for f in fields(record) if f.name not in set_here]
        for name in (n for n in names if hasattr(config, n)):
            assert getattr(got, name) == getattr(config, name), name
            copied.add(name)
    assert set(CHANGED) <= copied


def test_the_fields_set_here_come_from_the_checkpoint_and_the_resolved_flags(
    default_model_path: Path,
) -> None:
    config = replace(ServerConfig(), stall_timeout=7.5, grammar_compile_timeout=3.0, max_loras=4)
    mcfg = ModelConfig.from_pretrained(default_model_path)
    launch = frontend_launch(config, default_model_path, mcfg, 512, on_cpu=True)
    http = launch.http
    assert (http.max_model_len, http.vocab_size) == (512, mcfg.vocab_size)
    assert http.eos_token_ids == mcfg.eos_token_ids and http.model_name == default_model_path.name
    assert http.grammar_compile_timeout_s == 3.0 and http.max_loras == 0  # no --enable-lora
    assert launch.stall_timeout_s == 7.5 and launch.log_level == config.log_level.value
    assert launch.model == http.base_model_dir == str(default_model_path)
    assert launch.slo_ms is None  # no --workers: no planner
    assert FrontendLaunch.from_json(launch.to_json()) == launch
    lora = frontend_launch(replace(config, enable_lora=True), default_model_path, mcfg, 512, True)
    assert lora.http.max_loras == 4
