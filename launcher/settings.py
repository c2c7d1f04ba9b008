"""The launcher's settings: one frozen ``ServerConfig`` whose field defaults are the CLI's,
the choices its flags take, and ``ConfigError``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig, SpeculativeConfig
from frontend.settings import ConnectionLimits
from launcher.limit_args import DEFAULTS as LIMIT_DEFAULTS
from launcher.lora_args import DEFAULTS as LORA_DEFAULTS
from launcher.role_args import DEFAULTS as ROLE_DEFAULTS

API_KEY_ENV = "PDSERVE_API_KEY"
CLUSTER_KEY_ENV = "PDSERVE_CLUSTER_KEY"
# Set to anything but empty or 0: --enable-deterministic-inference where the flag is not
# given (vLLM's name for the same switch).
DETERMINISTIC_ENV = "VLLM_BATCH_INVARIANT"
DEFAULT_CLUSTER_PORT = 7481


class Device(enum.StrEnum):
    AUTO = "auto"  # CUDA when NVML finds an NVIDIA GPU, else CPU
    CPU = "cpu"
    CUDA = "cuda"


class DType(enum.StrEnum):
    AUTO = "auto"  # the checkpoint's dtype on GPU, float32 on CPU
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class KVBackend(enum.StrEnum):
    """How a prefill worker's KV reaches a decode worker (transport/kv_backends.py)."""

    AUTO = "auto"  # cuda_ipc when the workers run on CUDA, shm on CPU
    SHM = "shm"  # through shared host memory (on GPU: a pinned staging mirror per prefill)
    CUDA_IPC = "cuda_ipc"  # decode maps each prefill GPU pool and copies GPU to GPU


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


ROUTER_POLICIES = ("cache-aware", "least-load", "power-of-two", "round-robin")
_LIMITS = ConnectionLimits()


class ConfigError(ValueError):
    """The command line asks for something inconsistent; the message says what to change."""


# Tier 2's default size in GiB (benchmarks/results/kv_tiers.md measures its cost).
DEFAULT_KV_OFFLOAD_GIB = 1.0


# The engine's own defaults: every setting the launcher passes on to its engines starts
# from these, so the two cannot drift apart.
_ENGINE = EngineConfig(model="")
_ENGINE_DTYPE = DType(_ENGINE.dtype)


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``launch`` needs. ``model=None`` means the embedded default model.

    The field defaults are the CLI's (``launcher.flags``); those the engine also has are
    the engine's (``EngineConfig``)."""

    model: Path | None = None
    prefill: int = 1
    decode: int = 1
    detokenizers: int = 1
    api_workers: int = 1  # HTTP frontend processes sharing the port
    colocated: int = 0  # --workers N sets it to N (parse_args): co-located workers with roles
    # Roles the server chooses (launcher/role_args.py): N engine workers and the targets.
    workers: int = ROLE_DEFAULTS["workers"]
    slo_ttft_ms: float | None = ROLE_DEFAULTS["slo_ttft_ms"]
    slo_tpot_ms: float | None = ROLE_DEFAULTS["slo_tpot_ms"]
    allow_role_override: bool = ROLE_DEFAULTS["allow_role_override"]
    fork_workers: bool = True  # children forked from one interpreter that imported torch
    cpu_affinity: str = "auto"  # auto: engine main threads and the rest on their own cores
    host: str = "127.0.0.1"
    port: int = 8000
    device: Device = Device.AUTO
    prefill_gpus: tuple[int, ...] | None = None
    decode_gpus: tuple[int, ...] | None = None
    gpu_memory_utilization: float = _ENGINE.gpu_memory_utilization
    kv_cache_memory: float | None = None  # GiB per KV pool; None: from available memory
    kv_cache_tokens: int | None = None  # overrides kv_cache_memory
    kv_transfer: KVBackend = KVBackend.AUTO
    block_size: int = _ENGINE.block_size
    dtype: DType = _ENGINE_DTYPE
    quantization: str = _ENGINE.quantization
    gemm_min_rows: int = _ENGINE.gemm_min_rows  # 0: measured at load (engine/weights/gemm.py)
    gemm_inputs: str = _ENGINE.gemm_inputs  # bfloat16 | int8 (engine/weights/int4_tiles.py)
    # CPU workers map one copy of the weights per host (engine/checkpoint/shared_weights.py);
    # None: when the host runs two or more CPU engine workers (``launcher.engine_plan.shares_weights``)
    share_weights: bool | None = None
    max_model_len: int | None = _ENGINE.max_model_len
    max_num_seqs: int = _ENGINE.max_num_seqs
    chunked_prefill_size: int = _ENGINE.chunked_prefill_size
    mixed_batches: bool = _ENGINE.mixed_batches  # co-located: chunks + decode rows, one forward
    deterministic: bool = _ENGINE.deterministic  # batch-invariant serving
    enable_prefix_caching: bool = _ENGINE.enable_prefix_caching
    # KV tiers beyond the pools (launcher/kv_tiers.py): host RAM per host, then a directory.
    kv_offload_memory: float = DEFAULT_KV_OFFLOAD_GIB
    kv_offload_dir: Path | None = None
    kv_offload_disk: float = 16.0
    attention_backend: str = _ENGINE.attention_backend
    enforce_eager: bool = _ENGINE.enforce_eager
    # Decode (and co-located) workers verify several proposed tokens a step (engine/speculative/).
    speculative_config: SpeculativeConfig | None = None
    router_policy: str | None = None  # None: cache-aware with prefix caching, else least-load
    served_model_name: str | None = None
    api_key: str | None = None
    metrics_no_auth: bool = False
    allowed_hosts: tuple[str, ...] = ()
    allow_special_tokens_in_content: bool = False
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    max_json_depth: int = LIMIT_DEFAULTS["max_json_depth"]
    max_tools_bytes: int = LIMIT_DEFAULTS["max_tools_bytes"]
    max_schema_bytes: int = LIMIT_DEFAULTS["max_schema_bytes"]
    grammar_compile_timeout: float = LIMIT_DEFAULTS["grammar_compile_timeout"]
    grammar_workers: int = LIMIT_DEFAULTS["grammar_workers"]
    enable_lora: bool = LORA_DEFAULTS["enable_lora"]
    lora_modules: tuple[str, ...] = LORA_DEFAULTS["lora_modules"]
    max_loras: int = LORA_DEFAULTS["max_loras"]
    max_lora_rank: int = LORA_DEFAULTS["max_lora_rank"]
    max_waiting_requests: int = 1024
    max_queued_prefill_tokens: int = 262_144
    stall_timeout: float = 20.0  # seconds without a heartbeat before a worker's requests move
    max_request_retries: int = 1  # resumes of a request after worker deaths blamed on it
    timeout_header: float = _LIMITS.header_timeout_s
    timeout_body: float = _LIMITS.body_timeout_s
    timeout_keep_alive: float = _LIMITS.keep_alive_timeout_s
    max_connections: int = _LIMITS.max_connections
    max_connections_per_peer: int = _LIMITS.max_connections_per_peer
    log_level: LogLevel = LogLevel.INFO
    # Several hosts (docs/multi_host.md): a head node advertises the cluster link and
    # reserves rows and rings for the decode workers other nodes bring; a member joins it.
    node_name: str | None = None  # None: the host name
    advertise: str | None = None  # head: host[:port] the cluster link listens on
    remote_decode: int = 0  # head: decode workers other nodes will bring
    join: str | None = None  # member: the head's host:port
    cluster_key: str | None = None

    @property
    def disaggregated(self) -> bool:
        return self.colocated == 0

    @property
    def clustered(self) -> bool:
        return self.advertise is not None or self.join is not None

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            header_timeout_s=self.timeout_header,
            body_timeout_s=self.timeout_body,
            keep_alive_timeout_s=self.timeout_keep_alive,
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
        )

    @property
    def resolved_router_policy(self) -> str:
        if self.router_policy is not None:
            return self.router_policy
        return "cache-aware" if self.enable_prefix_caching else "least-load"


DEFAULTS = ServerConfig()
