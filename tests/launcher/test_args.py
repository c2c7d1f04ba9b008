"""The launch command line: defaults, validation messages, help text."""

from __future__ import annotations

import os
import shlex
from dataclasses import fields
from pathlib import Path

import pytest

from launcher.args import parse_args
from launcher.flags import build_parser
from launcher.settings import ConfigError, Device, DType, KVBackend, ServerConfig


def test_defaults_of_the_cli_are_the_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert parse_args([]) == ServerConfig()
    ns = build_parser().parse_args([])
    for f in fields(ServerConfig):
        assert getattr(ns, f.name) == f.default, f.name


def test_flags_land_in_typed_fields(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), *shlex.split("--prefill 2 --decode 4 --device cuda")]
    argv += ["--prefill-gpus", "0,1", "--decode-gpus", "2, 3,4,5", "--dtype", "bfloat16"]
    argv += shlex.split("--router-policy round-robin --max-model-len 4096")
    argv += shlex.split("--kv-transfer shm --max-queued-prefill-tokens 4096")
    argv += ["--no-enable-prefix-caching"]
    c = parse_args(argv)
    assert c.enable_prefix_caching is False
    assert c.kv_transfer is KVBackend.SHM and c.max_queued_prefill_tokens == 4096
    assert c.model == tmp_path and (c.prefill, c.decode) == (2, 4)
    assert c.device is Device.CUDA and c.dtype is DType.BFLOAT16
    assert c.prefill_gpus == (0, 1) and c.decode_gpus == (2, 3, 4, 5)
    assert c.router_policy == "round-robin" and c.max_model_len == 4096
    c = parse_args(["--enforce-eager", "--attention-backend", "torch"])
    assert c.enforce_eager and c.attention_backend == "torch"


def test_cache_aware_routing_is_the_default_exactly_when_prefix_caching_is_on() -> None:
    assert parse_args([]).resolved_router_policy == "cache-aware"
    assert parse_args(["--no-enable-prefix-caching"]).resolved_router_policy == "least-load"
    chosen = parse_args(["--router-policy", "least-load"])
    assert chosen.enable_prefix_caching and chosen.resolved_router_policy == "least-load"


def test_api_key_comes_from_the_environment_when_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env"
    assert parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert parse_args([]).api_key is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "0"], "--prefill must be >= 1"),
        (["--decode", "-1"], "--decode must be >= 1"),
        (shlex.split("--colocated 2 --prefill 3"), "drop --prefill/--decode"),
        (shlex.split("--colocated 2 --prefill-gpus 0"), "do not apply with --colocated"),
        (shlex.split("--prefill 2 --prefill-gpus 0"), "lists 1 GPUs for 2 workers"),
        (shlex.split("--device cpu --decode-gpus 1"), "--device cpu contradicts"),
        (["--gpu-memory-utilization", "1.5"], "in (0, 1]"),
        (["--kv-cache-tokens", "8"], "at least one block"),
        (["--max-model-len", "1"], "--max-model-len must be >= 2"),
        (["--port", "70000"], "not a TCP port"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1"),
        (["--max-queued-prefill-tokens", "0"], "--max-queued-prefill-tokens must be >= 1"),
        (shlex.split("--device cpu --kv-transfer cuda_ipc"), "cuda_ipc needs GPUs"),
        (shlex.split("--colocated 2 --kv-transfer shm"), "--kv-transfer does not apply"),
        (["--model", "/nonexistent/model"], "no config.json"),
        (["--router-policy", "cache-aware", "--no-enable-prefix-caching"], "needs prefix caching"),
        (["--node-name", ""], "--node-name is empty"),
        (["--node-name", "a\tb"], "--node-name 'a.+' holds characters that are not printable"),
        (["--node-name", "é" * 33], "--node-name 'é+' is 66 bytes of UTF-8; at most 64"),
    ],
)
def test_inconsistent_flags_are_config_errors_naming_the_flag(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        parse_args(argv)


def test_a_node_is_named_by_its_flag_or_else_its_host_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from launcher import cluster

    assert cluster.node_name(parse_args(["--node-name", "é" * 32])) == "é" * 32  # 64 bytes
    monkeypatch.setattr(cluster.socket, "gethostname", lambda: "host-1")
    assert cluster.node_name(parse_args([])) == "host-1"
    monkeypatch.setattr(cluster.socket, "gethostname", lambda: "h" * 65)  # not Linux's
    with pytest.raises(ConfigError, match=r"the host name 'h+' is 65 bytes.*give --node-name"):
        cluster.node_name(parse_args([]))


def test_malformed_values_are_rejected_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    bad = (
        ["--prefill-gpus", "a,b"],
        ["--device", "tpu"],
        ["--router-policy", "x"],
        ["--kv-transfer", "nccl"],
        ["--max-queued-prefill-tokens", "lots"],
    )
    for argv in bad:
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "comma-separated list of GPU indices" in capsys.readouterr().err


def test_help_explains_every_flag() -> None:
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.dest
    text = parser.format_help()
    assert "--prefill-gpus" in text and "503" in text
    assert "--kv-transfer" in text and "--max-queued-prefill-tokens" in text


def test_speculative_config_reaches_decode_workers_only() -> None:
    from dataclasses import replace

    from engine.config import SpeculativeConfig
    from launcher.cli import _engine_spec
    from launcher.placement import WorkerPlace
    from wire.roles import Role

    text = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5}'
    config = parse_args(["--speculative-config", text])
    assert config.speculative_config == SpeculativeConfig(
        num_speculative_tokens=6, prompt_lookup_max=5
    )
    assert parse_args([]).speculative_config is None
    config = replace(config, kv_cache_tokens=4096)
    for role, speculative in (
        (Role.PREFILL, None),
        (Role.DECODE, config.speculative_config),
        (Role.COLOCATED, config.speculative_config),
    ):
        place = WorkerPlace(role, 0, None, None)
        assert _engine_spec(config, Path("m"), place, "shm", {}).engine.speculative == speculative


def test_a_bad_speculative_config_is_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", '{"method": "medusa"}'])
    assert "--speculative-config: method must be one of" in capsys.readouterr().err


def test_deterministic_inference_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert parse_args([]).deterministic is False
    assert parse_args(["--enable-deterministic-inference"]).deterministic is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert parse_args([]).deterministic is True
    assert parse_args(["--no-enable-deterministic-inference"]).deterministic is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert parse_args([]).deterministic is False
    with pytest.raises(ConfigError, match="CPU only"):
        parse_args(["--enable-deterministic-inference", "--device", "cuda"])


def test_cpu_affinity_plans_for_cpu_engines_unless_off() -> None:
    from launcher.cli import _cpu_plan
    from launcher.gpus import GpuAssignment

    cpu = GpuAssignment(Device.CPU, (), (), (None,))
    gpu = GpuAssignment(Device.CUDA, (), (), (0,))
    cores = sorted(os.sched_getaffinity(0))
    auto = parse_args(["--colocated", "1"])
    assert auto.cpu_affinity == "auto"
    plan = _cpu_plan(auto, cpu)
    if len(cores) > 1:
        assert plan is not None and plan.homes == (cores[0],) and plan.rest == tuple(cores[1:])
    else:
        assert plan is None  # one core: nothing to keep apart
    assert _cpu_plan(parse_args(["--colocated", "1", "--cpu-affinity", "off"]), cpu) is None
    assert _cpu_plan(auto, gpu) is None  # GPU workers' host threads only feed the device
    with pytest.raises(SystemExit):
        parse_args(["--cpu-affinity", "sometimes"])
