"""The ``launch`` command line, built in groups of flags, each defaulting to the field of
``ServerConfig`` it fills (``launcher.args.parse_args`` reads them back)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from detokenizer.reasoning import PARSERS as REASONING_PARSERS
from engine.config import ATTENTION_BACKENDS, SpeculativeConfig, parse_speculative_config
from engine.weights.plan import QUANTIZATIONS
from frontend.api.chat.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from launcher.admission_args import add_admission_flags
from launcher.cluster_args import add_cluster_flags
from launcher.limit_args import add_request_limit_flags
from launcher.lora_args import add_lora_flags
from launcher.role_args import add_role_flags
from launcher.settings import (
    API_KEY_ENV,
    DEFAULTS,
    ROUTER_POLICIES,
    Device,
    DType,
    KVBackend,
    ServerConfig,
)
from wire.rids import MAX_FRONTENDS


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
    p = argparse.ArgumentParser(
        prog="launch",
        description="Serve a model with separate prefill and decode workers on this host.",
        formatter_class=_HelpFormatter,
    )
    for add_group, title in _GROUPS:
        add_group(p.add_argument_group(title), DEFAULTS)
    return p


def _workers(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
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
    add_role_flags(g)
    add(
        "--fork-workers",
        action=argparse.BooleanOptionalAction,
        default=d.fork_workers,
        help="start every child by forking one interpreter that has imported torch and "
        "the worker code (they share those pages, about 150 MiB a process, and a "
        "restarted worker starts at once); off, each child is a fresh interpreter",
    )
    add(
        "--cpu-affinity",
        choices=("auto", "off"),
        default=d.cpu_affinity,
        help="auto: on a CPU host with more cores than engine workers, each engine worker's "
        "main thread keeps to a core of its own (a lone worker's OpenMP threads, one to "
        "each core from there) and the detokenizers and HTTP frontends to the other cores, "
        "off the thread that drives each step; off: the OS scheduler places everything. "
        "Chosen within launch's own affinity: give two servers on one host their own cores "
        "(taskset), or turn it off",
    )
    add("--host", default=d.host, help="address the HTTP server listens on")
    add("--port", type=int, default=d.port, help="port the HTTP server listens on")


def _memory(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
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


def _engine(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
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
        "--gemm-inputs",
        choices=("bfloat16", "int8"),
        default=d.gemm_inputs,
        help="packed weights: what that GEMM feeds them. int8 quantizes each row's inputs "
        "per group of 32 (as llama.cpp's Q4 x Q8 products) and multiplies the int4 codes "
        "as bytes (AVX-512 VNNI): prefill GEMMs ~1.4x faster and no bfloat16 copy of the "
        "layers, for +0.4%% perplexity on the default model; outputs differ from bfloat16's",
    )
    add(
        "--share-weights",
        action=argparse.BooleanOptionalAction,
        default=d.share_weights,
        help="CPU workers map one copy of the read-only weights per host (GEMMs on plain "
        "bfloat16); off, each loads its own, GEMM weights prepacked for oneDNN (default: "
        "on with two or more CPU engine workers, off for a lone one, which shares with none)",
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
        help="most prompt tokens a prefill step processes; longer prompts are split (a "
        "CPU worker takes at most 256 a step while more than one request is in it)",
    )
    add(
        "--mixed-batches",
        action=argparse.BooleanOptionalAction,
        default=d.mixed_batches,
        help="co-located workers run a step's prompt chunks and its decode rows in one "
        "forward, reading the weights once for both (default: off, two forwards, the decode "
        "rows on the kernels a decode step of as many rows runs, so their tokens never "
        "depend on what else is prefilling; on a 2-core CPU mixing measured no faster)",
    )
    add(
        "--enable-deterministic-inference",
        dest="deterministic",
        action=argparse.BooleanOptionalAction,
        default=d.deterministic,
        help="batch-invariant serving: a request's tokens and logprobs do not depend on "
        "what else runs (kernels chosen per row, not per batch size; CPU only; docs/determinism.md"
        "); default: off, or on where VLLM_BATCH_INVARIANT=1 is set",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV cache of prompt prefixes a worker has already computed; off, "
        "every prompt is computed in full",
    )


def _kv_tiers(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
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


def _decoding(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
    add(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=d.attention_backend,
        help="GPU attention: auto and triton use the Triton kernels over the paged KV cache, "
        "torch uses PyTorch SDPA over gathered blocks; on CPU auto runs the fused CPU ops "
        "where their library loads (docs/gpu.md), torch the torch ops",
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
        '"prompt_lookup_max": 4}\' (also "disable_by_batch_size"; "adaptive": false verifies '
        'every draft, no cost-aware gate; method "draft_model" with "model": a checkpoint of '
        "the same vocabulary); outputs are identical to decoding without it",
    )
    add(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default=d.router_policy,
        help="how requests are spread over workers: cache-aware weighs the prompt tokens a "
        "worker already holds against its load (default with prefix caching; least-load "
        "without it)",
    )


def _api(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
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
    add_request_limit_flags(g)
    add_lora_flags(g)


_GROUPS: tuple[tuple[Callable[[argparse._ActionsContainer, ServerConfig], None], str], ...] = (
    (_workers, "Workers and the HTTP server"),
    (_memory, "Devices and memory"),
    (_engine, "The engine"),
    (_kv_tiers, "KV cache beyond the pools"),
    (_decoding, "Attention, decoding and routing"),
    (_api, "The API"),
    (add_admission_flags, "Admission and connections"),
    (add_cluster_flags, "Several hosts and logging"),
)
