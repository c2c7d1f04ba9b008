"""The ``launch`` command line: one frozen ``ServerConfig`` whose field defaults are the CLI's."""

from __future__ import annotations

import argparse
import enum
import os
from dataclasses import dataclass, fields
from pathlib import Path

from detokenizer.reasoning import PARSERS as REASONING_PARSERS
from engine.config import SpeculativeConfig, parse_speculative_config
from engine.weights.plan import QUANTIZATIONS
from frontend.openai.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from frontend.settings import ConnectionLimits
from launcher.limit_args import DEFAULTS as LIMIT_DEFAULTS
from launcher.limit_args import add_request_limit_flags, validate_request_limits
from launcher.lora_args import DEFAULTS as LORA_DEFAULTS
from launcher.lora_args import add_lora_flags, validate_lora_flags
from transport.load_table import NODE_NBYTES
from wire.rids import MAX_FRONTENDS

API_KEY_ENV = "PDSERVE_API_KEY"
CLUSTER_KEY_ENV = "PDSERVE_CLUSTER_KEY"
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
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # engine.cuda.kernels.ATTENTION_BACKENDS
_LIMITS = ConnectionLimits()


class ConfigError(ValueError):
    """The command line asks for something inconsistent; the message says what to change."""


# Tier 2's default size in GiB (benchmarks/results/kv_tiers.md measures its cost).
DEFAULT_KV_OFFLOAD_GIB = 1.0


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``launch`` needs. ``model=None`` means the embedded default model."""

    model: Path | None = None
    prefill: int = 1
    decode: int = 1
    detokenizers: int = 1
    api_workers: int = 1  # HTTP frontend processes sharing the port
    colocated: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    device: Device = Device.AUTO
    prefill_gpus: tuple[int, ...] | None = None
    decode_gpus: tuple[int, ...] | None = None
    gpu_memory_utilization: float = 0.85
    kv_cache_memory: float | None = None  # GiB per KV pool; None: from available memory
    kv_cache_tokens: int | None = None  # overrides kv_cache_memory
    kv_transfer: KVBackend = KVBackend.AUTO
    block_size: int = 16
    dtype: DType = DType.AUTO
    quantization: str = "auto"
    gemm_min_rows: int = 0  # 0: the crossover measured at load (engine/weights/gemm.py)
    max_model_len: int | None = None
    max_num_seqs: int = 256
    chunked_prefill_size: int = 2048
    enable_prefix_caching: bool = True
    # KV tiers beyond the pools (launcher/kv_tiers.py): host RAM per host, then a directory.
    kv_offload_memory: float = DEFAULT_KV_OFFLOAD_GIB
    kv_offload_dir: Path | None = None
    kv_offload_disk: float = 16.0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # Decode (and co-located) workers verify several proposed tokens a step (engine/spec/).
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


_DEFAULTS = ServerConfig()


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of GPU indices, e.g. 0,1"
        ) from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: give GPU indices >= 0, e.g. 0,1")
    return ids


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones: their help line already says what None means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="launch",
        description="Serve a model with separate prefill and decode workers on this host.",
        formatter_class=_HelpFormatter,
    )
    add = p.add_argument
    add(
        "--model",
        type=Path,
        default=d.model,
        help="local Hugging Face checkpoint directory or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    add("--prefill", type=int, default=d.prefill, help="number of prefill workers")
    add("--decode", type=int, default=d.decode, help="number of decode workers")
    add("--detokenizers", type=int, default=d.detokenizers, help="number of detokenizer processes")
    add(
        "--api-workers",
        type=int,
        default=d.api_workers,
        help="number of HTTP frontend processes (tokenization, chat templates, streaming) "
        f"sharing the port; admission limits stay server-wide (at most {MAX_FRONTENDS})",
    )
    add(
        "--colocated",
        type=int,
        default=d.colocated,
        help="run this many workers that each prefill and decode their own requests "
        "(no KV transfer; the benchmark baseline) instead of separate pools",
    )
    add("--host", default=d.host, help="address the HTTP server listens on")
    add("--port", type=int, default=d.port, help="port the HTTP server listens on")
    add(
        "--device",
        type=Device,
        choices=list(Device),
        default=d.device,
        help="where the model runs; auto picks CUDA when an NVIDIA GPU is present",
    )
    add(
        "--prefill-gpus",
        type=_gpu_list,
        default=d.prefill_gpus,
        help="GPU index for each prefill worker, e.g. 0,1 (default: the first GPUs)",
    )
    add(
        "--decode-gpus",
        type=_gpu_list,
        default=d.decode_gpus,
        help="GPU index for each decode worker, e.g. 2,3 (default: the GPUs after prefill's)",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="fraction of each GPU's total memory that the pdserve workers on it may use "
        "together (weights, activations, KV cache); workers sharing a GPU split it evenly",
    )
    add(
        "--kv-cache-memory",
        type=float,
        default=d.kv_cache_memory,
        help="KV cache per worker in GiB of host memory (CPU pools; on GPU with --kv-transfer "
        "shm, each prefill worker's pinned staging mirror and its pool). Default: a share of "
        "the memory available now, after every worker's weights, at most 4 GiB",
    )
    add(
        "--kv-cache-tokens",
        type=int,
        default=d.kv_cache_tokens,
        help="KV cache per worker in tokens; overrides --kv-cache-memory",
    )
    add(
        "--kv-transfer",
        type=KVBackend,
        choices=list(KVBackend),
        default=d.kv_transfer,
        help="how KV moves from prefill to decode workers: shm (shared host memory), "
        "cuda_ipc (GPU to GPU, GPUs only); auto picks cuda_ipc on GPUs and shm on CPU",
    )
    add("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    add(
        "--dtype",
        type=DType,
        choices=list(DType),
        default=d.dtype,
        help="weight and activation precision; auto uses the checkpoint's (float32 on CPU)",
    )
    add(
        "--quantization",
        choices=QUANTIZATIONS,
        default=d.quantization,
        help="weight storage: auto serves a GGUF's Q4_0/Q4_1/Q8_0 blocks packed (the default "
        "model's Q4_1 included) and any other checkpoint as stored; none serves dense "
        "weights (--dtype; float32 on CPU); int8/int4 quantize at load (groups of 32). "
        "Quantized weights run with bfloat16 activations (CPU only)",
    )
    add(
        "--gemm-min-rows",
        type=int,
        default=d.gemm_min_rows,
        help="packed weights: rows from which a linear layer runs a bfloat16 GEMM instead of "
        "the packed kernel (prefill chunks, large decode batches); 0 measures the crossover "
        "on this CPU at load and caches it",
    )
    add(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt + output in tokens (default: the model's context length)",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="most requests a worker runs in one batch",
    )
    add(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help="most prompt tokens a prefill step processes; longer prompts are split",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV cache of prompt prefixes a worker has already computed; off, "
        "every prompt is computed in full",
    )
    add(
        "--kv-offload-memory",
        type=float,
        default=d.kv_offload_memory,
        help="GiB of host RAM, per host, holding KV blocks beyond the workers' pools, shared "
        "by every worker of the host (tier 2); 0 turns the KV tiers off",
    )
    add(
        "--kv-offload-dir",
        type=Path,
        default=d.kv_offload_dir,
        help="a local directory holding KV blocks beyond tier 2, one verified file per "
        "block, found again after a restart (tier 3)",
    )
    add(
        "--kv-offload-disk",
        type=float,
        default=d.kv_offload_disk,
        help="GiB --kv-offload-dir may hold (least recently used blocks go first)",
    )
    add(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=d.attention_backend,
        help="GPU attention: auto and triton use the Triton kernels over the paged KV cache, "
        "torch uses PyTorch SDPA over gathered blocks (CPU always runs torch)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        default=d.enforce_eager,
        help="GPU: run every decode step eagerly instead of replaying CUDA graphs",
    )
    add(
        "--speculative-config",
        type=_speculative,
        default=d.speculative_config,
        help="speculative decoding on decode workers, as JSON with vLLM's names, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}\' (also "disable_by_batch_size"; method "draft_model" with '
        '"model": a checkpoint of the same vocabulary); outputs are identical to decoding '
        "without it",
    )
    add(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default=d.router_policy,
        help="how requests are spread over workers: cache-aware weighs the prompt tokens a "
        "worker already holds against its load (default with prefix caching; least-load "
        "without it)",
    )
    add(
        "--served-model-name",
        default=d.served_model_name,
        help="model name clients send and see (default: the model directory's or .gguf "
        "file's name; the --model path is accepted too)",
    )
    add(
        "--api-key",
        default=d.api_key,
        help=f"require this bearer token from clients on every path but /health "
        f"(or set {API_KEY_ENV})",
    )
    add(
        "--metrics-no-auth",
        action="store_true",
        help="serve /metrics without the API key (for a Prometheus scraper that has none)",
    )
    add(
        "--allowed-hosts",
        type=_names,
        default=d.allowed_hosts,
        help="without --api-key, Host names besides localhost, IP addresses and --host that "
        "requests may carry, comma-separated ('*': any); other names get 421, a defence "
        "against DNS rebinding",
    )
    add(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="let control-token text in chat messages (e.g. <|im_start|>) become control "
        "tokens, as before; by default it stays text, so users cannot forge roles",
    )
    add(
        "--chat-template",
        default=d.chat_template,
        help="Jinja chat template file or text overriding the tokenizer's",
    )
    add(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=d.tool_call_parser,
        help="how tool calls are read out of chat output (vLLM's names); without one, "
        "tool_choice 'auto' is refused ('required' and named choices need none)",
    )
    add(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=d.reasoning_parser,
        help="keep a model's <think>…</think> reasoning apart from its answer (vLLM's "
        "names): reasoning_content in chat completions, thinking blocks in /v1/messages, "
        "reasoning items in /v1/responses",
    )
    add_request_limit_flags(p)
    add_lora_flags(p)
    add(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="queued requests per worker beyond which new ones get HTTP 503 + Retry-After",
    )
    add(
        "--max-queued-prefill-tokens",
        type=int,
        default=d.max_queued_prefill_tokens,
        help="admission bound: prompt tokens queued on a prefill worker beyond which new "
        "requests get HTTP 503 + Retry-After (an idle worker still takes any prompt)",
    )
    add(
        "--stall-timeout",
        type=float,
        default=d.stall_timeout,
        help="seconds a READY worker may go without a heartbeat before its requests are "
        "resumed on other workers (it is reported stalled in /health after a quarter of it)",
    )
    add(
        "--timeout-header",
        type=float,
        default=d.timeout_header,
        help="seconds a client has to send a whole request head (from connecting, or from "
        "the first byte of its next request); then 408 and closed",
    )
    add(
        "--timeout-body",
        type=float,
        default=d.timeout_body,
        help="seconds a client has to send a whole request body after its head; then 408 "
        "and closed",
    )
    add(
        "--timeout-keep-alive",
        type=float,
        default=d.timeout_keep_alive,
        help="seconds an idle kept-alive connection stays open between requests",
    )
    add(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="most client connections the frontend holds; beyond it new ones get 503 "
        "(0: the descriptor limit less a reserve that keeps /health answering)",
    )
    add(
        "--max-connections-per-peer",
        type=int,
        default=d.max_connections_per_peer,
        help="most connections one client address may hold; beyond it new ones get 503 "
        "(0: no cap; a reverse proxy on this host is one address)",
    )
    add(
        "--node-name",
        default=d.node_name,
        help="this host's name in /health, /metrics and a cluster (default: its host "
        f"name); printable, at most {NODE_NBYTES} bytes of UTF-8",
    )
    add(
        "--advertise",
        default=d.advertise,
        metavar="HOST[:PORT]",
        help="serve as a cluster's head node: the address (and port, default "
        f"{DEFAULT_CLUSTER_PORT}) other nodes --join; the link listens on it only",
    )
    add(
        "--remote-decode",
        type=int,
        default=d.remote_decode,
        help="with --advertise: how many decode workers the joining nodes bring in all",
    )
    add(
        "--join",
        default=d.join,
        metavar="HOST:PORT",
        help="join the cluster whose head node advertises HOST:PORT, bringing this "
        "node's --decode workers (--prefill 0); needs pip install 'pdserve[nixl]'",
    )
    add(
        "--cluster-key",
        default=d.cluster_key,
        help=f"the secret every node of a cluster shares (or set {CLUSTER_KEY_ENV}); "
        "at least 16 characters",
    )
    add(
        "--log-level",
        type=LogLevel,
        choices=list(LogLevel),
        default=d.log_level,
        help="how much the server logs",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """Parse and validate; raises ``ConfigError`` naming the flag to change."""
    ns = build_parser().parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(ServerConfig)}
    values["lora_modules"] = tuple(values["lora_modules"])
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    if values["cluster_key"] is None:
        values["cluster_key"] = os.environ.get(CLUSTER_KEY_ENV) or None
    config = ServerConfig(**values)
    validate(config)
    return config


def validate(config: ServerConfig) -> None:
    c = config
    _positive(("--detokenizers", c.detokenizers), ("--api-workers", c.api_workers),
              ("--block-size", c.block_size),
              ("--max-num-seqs", c.max_num_seqs),
              ("--chunked-prefill-size", c.chunked_prefill_size),
              ("--max-waiting-requests", c.max_waiting_requests),
              ("--max-queued-prefill-tokens", c.max_queued_prefill_tokens))  # fmt: skip
    if c.gemm_min_rows < 0:
        raise ConfigError(f"--gemm-min-rows must be >= 0 (0: measured), got {c.gemm_min_rows}")
    if c.api_workers > MAX_FRONTENDS:
        raise ConfigError(f"--api-workers must be at most {MAX_FRONTENDS}, got {c.api_workers}")
    if c.colocated < 0:
        raise ConfigError("--colocated must be >= 0")
    if c.colocated > 0:
        if (c.prefill, c.decode) != (_DEFAULTS.prefill, _DEFAULTS.decode):
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
        raise ConfigError("--kv-offload-dir is fed from host RAM: it needs prefix caching and "
                          "--kv-offload-memory > 0")  # fmt: skip
    if c.router_policy == "cache-aware" and not c.enable_prefix_caching:
        raise ConfigError("--router-policy cache-aware needs prefix caching: drop "
                          "--no-enable-prefix-caching or pick another policy")  # fmt: skip
    if c.stall_timeout <= 0:
        raise ConfigError("--stall-timeout must be a positive number of seconds")
    for flag, seconds in (("--timeout-header", c.timeout_header),
                          ("--timeout-body", c.timeout_body),
                          ("--timeout-keep-alive", c.timeout_keep_alive)):  # fmt: skip
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
    for flag, gpus, count in (("--prefill-gpus", c.prefill_gpus, c.prefill),
                              ("--decode-gpus", c.decode_gpus, c.decode)):  # fmt: skip
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
            raise ConfigError("--advertise needs --remote-decode N: the decode workers "
                              "other nodes will bring")  # fmt: skip
    if c.join is not None:
        split_host_port(c.join, "--join")
    if not c.cluster_key or len(c.cluster_key) < 16:
        raise ConfigError(f"several hosts need --cluster-key (or {CLUSTER_KEY_ENV}) of at "
                          "least 16 characters, the same on every node")  # fmt: skip


def _positive(*pairs: tuple[str, int]) -> None:
    for flag, value in pairs:
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
