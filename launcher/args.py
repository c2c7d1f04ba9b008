"""The ``launch`` command line read into a ``ServerConfig`` and checked as a whole: every
refusal is a ``ConfigError`` naming the flag to change."""

from __future__ import annotations

import os
import sys
from dataclasses import fields, replace

from launcher.flags import build_parser
from launcher.limit_args import validate_request_limits
from launcher.lora_args import validate_lora_flags
from launcher.role_args import validate_role_flags
from launcher.settings import (
    API_KEY_ENV,
    CLUSTER_KEY_ENV,
    DEFAULT_CLUSTER_PORT,
    DEFAULTS,
    DETERMINISTIC_ENV,
    ConfigError,
    Device,
    KVBackend,
    ServerConfig,
)
from transport.load_table import NODE_NBYTES
from wire.rids import MAX_FRONTENDS


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """Parse and validate; raises ``ConfigError`` naming the flag to change."""
    ns = build_parser().parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(ServerConfig)}
    values["lora_modules"] = tuple(values["lora_modules"])
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    if values["cluster_key"] is None:
        values["cluster_key"] = os.environ.get(CLUSTER_KEY_ENV) or None
    given = sys.argv[1:] if argv is None else argv
    if os.environ.get(DETERMINISTIC_ENV, "").strip() not in ("", "0") and not any(
        a.startswith("--no-enable-deterministic") for a in given
    ):  # the environment's switch, unless the flag turned it off
        values["deterministic"] = True
    config = ServerConfig(**values)
    if (problem := validate_role_flags(config, DEFAULTS)) is not None:
        raise ConfigError(problem)
    if config.workers:  # co-located workers that also hand KV off (launcher/role_args.py)
        config = replace(config, colocated=config.workers)
    validate(config)
    return config


def validate(config: ServerConfig) -> None:
    c = config
    _positive(
        ("--detokenizers", c.detokenizers),
        ("--api-workers", c.api_workers),
        ("--block-size", c.block_size),
        ("--max-num-seqs", c.max_num_seqs),
        ("--chunked-prefill-size", c.chunked_prefill_size),
        ("--max-waiting-requests", c.max_waiting_requests),
        ("--max-queued-prefill-tokens", c.max_queued_prefill_tokens),
    )
    if c.deterministic and c.device is Device.CUDA:
        raise ConfigError(
            "--enable-deterministic-inference runs on CPU only for now: drop it, or serve "
            "with --device cpu"
        )
    if c.gemm_min_rows < 0:
        raise ConfigError(f"--gemm-min-rows must be >= 0 (0: measured), got {c.gemm_min_rows}")
    if c.api_workers > MAX_FRONTENDS:
        raise ConfigError(f"--api-workers must be at most {MAX_FRONTENDS}, got {c.api_workers}")
    if c.colocated < 0:
        raise ConfigError("--colocated must be >= 0")
    if c.colocated > 0:
        if (c.prefill, c.decode) != (DEFAULTS.prefill, DEFAULTS.decode):
            raise ConfigError(
                "--colocated replaces the prefill/decode pools: drop --prefill/--decode"
            )
        if c.prefill_gpus is not None or c.decode_gpus is not None:
            raise ConfigError("--prefill-gpus/--decode-gpus do not apply with --colocated")
        if c.kv_transfer is not KVBackend.AUTO:
            raise ConfigError("--kv-transfer does not apply with --colocated (no KV handoff)")
    elif c.join is not None:
        if c.prefill != 0:
            raise ConfigError("a node that --joins brings decode workers only: give --prefill 0")
        _positive(("--decode", c.decode))
    else:
        _positive(("--prefill", c.prefill))
        if c.decode < 0 or c.decode + c.remote_decode < 1:
            raise ConfigError("--decode must be >= 1 (or >= 0 with --remote-decode)")
    _validate_cluster(c)
    if (problem := validate_request_limits(c)) is not None:
        raise ConfigError(problem)
    if (problem := validate_lora_flags(c)) is not None:
        raise ConfigError(problem)
    if c.max_model_len is not None and c.max_model_len < 2:
        raise ConfigError("--max-model-len must be >= 2 (one prompt and one output token)")
    if c.kv_cache_tokens is not None and c.kv_cache_tokens < c.block_size:
        raise ConfigError("--kv-cache-tokens must hold at least one block (--block-size tokens)")
    if c.kv_cache_memory is not None and c.kv_cache_memory <= 0:
        raise ConfigError("--kv-cache-memory must be a positive number of GiB")
    if c.kv_cache_memory is not None and c.kv_cache_tokens is not None:
        raise ConfigError("give --kv-cache-memory or --kv-cache-tokens, not both")
    if c.kv_offload_memory < 0 or c.kv_offload_disk <= 0:
        raise ConfigError("--kv-offload-memory must be >= 0 and --kv-offload-disk > 0 GiB")
    if c.kv_offload_dir is not None and not (c.kv_offload_memory and c.enable_prefix_caching):
        raise ConfigError(
            "--kv-offload-dir is fed from host RAM: it needs prefix caching and "
            "--kv-offload-memory > 0"
        )
    if c.router_policy == "cache-aware" and not c.enable_prefix_caching:
        raise ConfigError(
            "--router-policy cache-aware needs prefix caching: drop "
            "--no-enable-prefix-caching or pick another policy"
        )
    if c.stall_timeout <= 0:
        raise ConfigError("--stall-timeout must be a positive number of seconds")
    if c.max_request_retries < 0:
        raise ConfigError("--max-request-retries must be 0 or more")
    for flag, seconds in (
        ("--timeout-header", c.timeout_header),
        ("--timeout-body", c.timeout_body),
        ("--timeout-keep-alive", c.timeout_keep_alive),
    ):
        if not seconds > 0:
            raise ConfigError(f"{flag} must be > 0 seconds, got {seconds}")
    if c.max_connections < 0 or c.max_connections_per_peer < 0:
        raise ConfigError("--max-connections and --max-connections-per-peer must be >= 0")
    if not 0.0 < c.gpu_memory_utilization <= 1.0:
        raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
    if not 0 <= c.port <= 65535:
        raise ConfigError(f"--port {c.port} is not a TCP port (0..65535)")
    if c.model is not None and c.model.suffix == ".gguf":
        if not c.model.is_file():
            raise ConfigError(f"--model {c.model}: no such GGUF file")
    elif c.model is not None and not (c.model / "config.json").is_file():
        raise ConfigError(
            f"--model {c.model}: no config.json there; give a checkpoint directory or a .gguf file"
        )
    for flag, gpus, count in (
        ("--prefill-gpus", c.prefill_gpus, c.prefill),
        ("--decode-gpus", c.decode_gpus, c.decode),
    ):
        if gpus is not None and len(gpus) != count:
            raise ConfigError(f"{flag} lists {len(gpus)} GPUs for {count} workers; give one each")
    if c.device is Device.CPU and (c.prefill_gpus or c.decode_gpus):
        raise ConfigError("--device cpu contradicts --prefill-gpus/--decode-gpus")
    if c.device is Device.CPU and c.kv_transfer is KVBackend.CUDA_IPC:
        raise ConfigError("--kv-transfer cuda_ipc needs GPUs; with --device cpu use shm or auto")


def split_host_port(text: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "" if default_port is None else str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        want = "HOST:PORT" if default_port is None else "HOST[:PORT]"
        raise ConfigError(f"{flag} {text!r}: expected {want}")
    return host.strip("[]"), int(port)


def check_node_name(name: str, what: str) -> None:
    """A node's name must fit its load-table rows (``NODE_NBYTES`` of UTF-8) and read
    plainly in /health, /metrics and logs: printable, not empty. ``what`` names its source."""
    if not name:
        raise ConfigError(f"{what} is empty: give this node a name")
    if not name.isprintable():
        raise ConfigError(f"{what} {name!r} holds characters that are not printable")
    size = len(name.encode())
    if size > NODE_NBYTES:
        raise ConfigError(f"{what} {name!r} is {size} bytes of UTF-8; at most {NODE_NBYTES}")


def _validate_cluster(c: ServerConfig) -> None:
    if c.node_name is not None:  # it names the node on one host too
        check_node_name(c.node_name, "--node-name")
    if c.remote_decode < 0:
        raise ConfigError("--remote-decode must be >= 0")
    if c.remote_decode and c.advertise is None:
        raise ConfigError("--remote-decode needs --advertise (the address other nodes join)")
    if not c.clustered:
        return
    if c.advertise is not None and c.join is not None:
        raise ConfigError("--advertise (head node) and --join (member) exclude each other")
    if c.colocated:
        raise ConfigError("--colocated serves on one host; drop --advertise/--join")
    if c.advertise is not None:
        split_host_port(c.advertise, "--advertise", DEFAULT_CLUSTER_PORT)
        if c.remote_decode < 1:
            raise ConfigError(
                "--advertise needs --remote-decode N: the decode workers other nodes will bring"
            )
    if c.join is not None:
        split_host_port(c.join, "--join")
    if not c.cluster_key or len(c.cluster_key) < 16:
        raise ConfigError(
            f"several hosts need --cluster-key (or {CLUSTER_KEY_ENV}) of at "
            "least 16 characters, the same on every node"
        )


def _positive(*pairs: tuple[str, int]) -> None:
    for flag, value in pairs:
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
