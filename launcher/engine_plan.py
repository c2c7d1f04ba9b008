"""What the launcher decides about the engines before it creates anything: the weight
storage and KV dtype every engine worker will use (``serving_dtypes``), whether CPU
workers share one weights segment (``shares_weights``), each host KV pool's size from the
memory budget (``size_kv``, ``launcher/memory.py``) and its layout (``kv_layout``)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig, ModelConfig, dtype_name
from engine.kv.kv_cache import pool_layout
from engine.weights.plan import QuantizationError, cache_dtype_name, resolve_quantization
from launcher import kv_tiers
from launcher.gpus import GpuAssignment
from launcher.memory import Demand, MemoryBudgetError, plan_kv, weight_bytes
from launcher.settings import ConfigError, KVBackend, ServerConfig
from wire.kv_layout import KVLayout

logger = logging.getLogger("launch")

# GPU pools are sized from GPU memory; this only sizes a pool no host memory backs.
DEFAULT_GPU_KV_TOKENS = 65_536


def serving_dtypes(
    config: ServerConfig, model: Path, gpus: GpuAssignment | None
) -> tuple[str, str]:
    """The weight storage and KV cache dtype (by name) every engine worker will use."""
    device = "cpu" if gpus is None or gpus.on_cpu else "cuda"
    try:
        quantization = resolve_quantization(config.quantization, model, device)
    except QuantizationError as e:
        raise ConfigError(f"--quantization: {e}") from e
    dtype = dtype_name(config.dtype.value, ModelConfig.from_pretrained(model).dtype_name)
    if config.gemm_inputs == "int8":
        _check_int8_gemm(quantization)
    return quantization, cache_dtype_name(dtype, quantization)


def _check_int8_gemm(quantization: str) -> None:
    """``--gemm-inputs int8`` where no engine could serve it is a flag error here, not a
    worker that fails at load (engine/weights/int4_tiles.py ``gemm_inputs``)."""
    if quantization == "none":
        raise ConfigError(
            "--gemm-inputs int8 multiplies packed int4/int8 weights: serve them with "
            "--quantization auto (a GGUF's Q4/Q8 blocks), int4 or int8"
        )
    try:
        flags = next(
            set(line.split(":", 1)[1].split())
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = set()
    missing = sorted({"avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl"} - flags)
    if missing:
        raise ConfigError(
            f"--gemm-inputs int8 needs AVX-512 VNNI and BF16; this CPU lacks {', '.join(missing)}"
        )


def kv_layout(config: ServerConfig, model: Path, gpus: GpuAssignment | None) -> KVLayout:
    """A host KV pool's layout (the shm pools, and what a cluster's nodes must share)."""
    mcfg = ModelConfig.from_pretrained(model)
    dtype = serving_dtypes(config, model, gpus)[1]
    assert config.kv_cache_tokens is not None, "sized by size_kv"
    num_blocks = -(-config.kv_cache_tokens // config.block_size)
    return pool_layout(mcfg, num_blocks, config.block_size, dtype)


def shares_weights(config: ServerConfig, gpus: GpuAssignment) -> bool:
    """Whether this host's CPU engine workers map one weights segment: ``--share-weights``,
    by default when there are two or more of them. A lone worker would share with nobody,
    so it loads privately, its GEMM weights in the fastest layout its CPU runs
    (``engine.weights.gemm.bf16_gemm``): the kernel library's VNNI-packed one where it
    loads, as shared workers run; elsewhere oneDNN's prepacked one, which no segment can
    hold (against the plain shared weight: TTFT 0.91-0.95x, a 32-row decode step ~0.9x,
    for ~80 MiB more PSS; ``benchmarks/results/lone_worker_weights.md``). A restart then
    reads the checkpoint again."""
    if not gpus.on_cpu:
        return False
    if config.share_weights is not None:
        return config.share_weights
    return (config.colocated or config.prefill + config.decode) >= 2


def size_kv(
    config: ServerConfig, model: Path, gpus: GpuAssignment, backend: KVBackend
) -> ServerConfig:
    """``config`` with ``kv_cache_tokens`` set from the host-memory budget (or checked)."""
    mcfg = ModelConfig.from_pretrained(model)
    quantization, dtype = serving_dtypes(config, model, gpus)
    workers = config.colocated or config.prefill + config.decode
    if gpus.on_cpu:
        engines = pools = workers
    else:  # weights live on the GPUs; host pools are the shm staging mirrors, if any
        engines, pools = 0, (config.prefill if backend is KVBackend.SHM else 0)
    if pools == 0:
        return replace(config, kv_cache_tokens=config.kv_cache_tokens or DEFAULT_GPU_KV_TOKENS)
    engine = EngineConfig(model=str(model), max_model_len=config.max_model_len)
    try:
        # Packed weights take about a byte a parameter (int8: 1.06 with its scales, int4:
        # about 0.6), and their bfloat16 GEMM copies two more (engine/weights/gemm.py).
        weights = weight_bytes(model, dtype if quantization == "none" else "int8")
        if quantization != "none":
            weights += weight_bytes(model, "bfloat16")
            if mcfg.tie_word_embeddings:
                # The checkpoint holds one matrix for embedding and head; served packed,
                # the head has its own int8 planes (1.25 bytes a weight with scales and
                # zeros) and GEMM copy (2) beside the embedding's rows.
                weights += mcfg.vocab_size * mcfg.hidden_size * 13 // 4
        # Shared (engine/checkpoint/shared_weights.py): one copy for every CPU worker.
        shared = weights if shares_weights(config, gpus) else 0
        demand = Demand(
            engines=engines,
            others=config.api_workers + config.detokenizers,
            pools=pools,
            chunk=config.chunked_prefill_size,
            max_model_len=engine.resolve_max_model_len(mcfg),
            offload=kv_tiers.offload_bytes(config),
            shared_weights=shared,
        )
        per_replica = weights - shared
        plan = plan_kv(
            mcfg, per_replica, dtype, demand, config.kv_cache_memory, config.kv_cache_tokens
        )
    except (MemoryBudgetError, ValueError) as e:
        raise ConfigError(str(e)) from e
    logger.info("%s", plan.describe(pools))
    return replace(config, kv_cache_tokens=plan.tokens_per_pool)
