"""Assembling one model's engine: weights, adapters, grammars, attention backend, KV pool.

Who calls what: a worker (or ``colocated.llm.LLM``, a test, a benchmark) calls
``build_engine(config)`` once and hands the parts to its schedulers: the ``runner`` runs
forwards and samples, ``kv`` (the ``KVPool``) holds the blocks the schedulers assign,
share, pin and free, ``grammars`` compiles grammars on arrival, ``loras`` answers whether
an adapter can run, ``stops`` says when a sequence ends. The runner holds the same pool
(its forwards write into it and publish the blocks they fill) and the same adapters.

Order matters: the pool is sized last, since on CUDA its size is what a profiling forward
leaves of this worker's GPU share (``engine/cuda/gpu_memory.py``); the runner runs that
forward on a scratch pool before it has its own.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.lora_loader import LoraAdapters
from engine.checkpoint.shared_weights import load_model
from engine.config import EngineConfig, ModelConfig, dtype_name, torch_dtype
from engine.cuda.gpu_memory import gpu_kv_blocks
from engine.cuda.kernels import use_kernels
from engine.kv.kv_cache import GpuMemoryError
from engine.kv.pool import KVPool
from engine.model.batch_invariance import (
    check_device,
    fused_attention_invariant,
    make_batch_invariant,
)
from engine.model.causal_lm import CausalLM
from engine.model.fused_cpu import cpu_backend
from engine.model.torch_backend import TorchBackend, TorchGeometry
from engine.runner import LoadedModel, ModelRunner
from engine.sampling.grammar import GrammarCache
from engine.sampling.stops import Stops
from engine.tokenizer.hf_tokenizer import load_tokenizer
from engine.weights.plan import cache_dtype, resolve_quantization

if TYPE_CHECKING:
    from engine.cuda.kernel_path import KernelPath

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Engine:
    """One model's engine, as its schedulers use it (see the module docstring)."""

    config: EngineConfig
    runner: ModelRunner
    kv: KVPool
    grammars: GrammarCache
    loras: LoraAdapters | None
    stops: Stops


def build_engine(config: EngineConfig, kv_pool: torch.Tensor | None = None) -> Engine:
    """Load ``config.model`` and assemble its engine; ``kv_pool``: a pool tensor to use
    (shared memory a peer also maps) instead of allocating one."""
    loaded = load_weights(config)
    model, device = loaded.model, loaded.device
    kernels = use_kernels(config.attention_backend, device.type)
    loras = None
    if config.max_loras > 0:
        bank = None
        if kernels:  # graphs need fixed addresses: adapters go into preallocated slots
            from engine.cuda.lora_bank import StackedLoraBank

            bank = StackedLoraBank.factory(config.max_loras, loaded.dtype, device)
        loras = LoraAdapters(model, config.model, config.max_loras, config.max_lora_rank, bank)
    eos = loaded.model_config.eos_token_ids
    grammars = GrammarCache(
        lambda: load_tokenizer(config.model),  # when a grammar first needs it
        loaded.model_config.vocab_size,
        eos,
        model_dir=config.model,
    )
    kernel_path: KernelPath | None = None
    if kernels:
        from engine.cuda.kernel_path import KernelPath  # imports triton: only when used

        kernel_path = KernelPath(model, loaded.model_config, config, loaded.max_model_len)
    if device.type == "cuda":
        # SDPA (the torch attention path) keeps to the flash and memory-efficient
        # kernels: cuDNN's backend has open silent-correctness bugs
        # (pytorch/pytorch#193893: corrupted greedy output for GQA models).
        torch.backends.cuda.enable_cudnn_sdp(False)
    runner = ModelRunner(
        config, loaded, _torch_backend(config, loaded), kernel_path, loras, grammars
    )
    runner.use_pool(_make_pool(runner, kv_pool))
    logger.info(
        "%s: %d KV blocks of %d tokens, max_model_len %d, %s weights, %s on %s",
        loaded.model_config.architecture,
        runner.kv.num_blocks,
        config.block_size,
        loaded.max_model_len,
        loaded.quantization,
        loaded.dtype,
        device,
    )
    return Engine(config, runner, runner.kv, grammars, loras, Stops(eos, loaded.max_model_len))


def load_weights(config: EngineConfig) -> LoadedModel:
    """``config.model``'s weights on ``config.device``, in the dtype and quantization the
    config and checkpoint resolve to."""
    model_config = ModelConfig.from_pretrained(config.model)
    device = torch.device(config.device)
    quantization = resolve_quantization(config.quantization, Path(config.model), config.device)
    dtype = torch_dtype(dtype_name(config.dtype, model_config.dtype_name))
    max_model_len = config.resolve_max_model_len(model_config)
    # What this process held on the GPU before this engine: not part of its share.
    # Garbage first (an earlier engine's cycles): freed later, it would count against us.
    baseline = 0
    if device.type == "cuda":
        gc.collect()
        baseline = torch.cuda.memory_allocated(device)
    if config.deterministic:
        check_device(device)
    model = load_model(
        lambda: CausalLM(model_config, max_model_len, dtype, device), config, quantization, dtype
    )
    if config.deterministic:  # per-row arithmetic at every step (batch_invariance.py)
        make_batch_invariant(model)
    return LoadedModel(
        model,
        model_config,
        device,
        quantization,
        dtype,
        cache_dtype(dtype, quantization),
        max_model_len,
        baseline,
    )


def _torch_backend(config: EngineConfig, loaded: LoadedModel) -> TorchBackend:
    """The torch path's backend: on CPU the fused ops where their library loads, whose
    attention reads the pool in place (no dense copy, no gathered blocks)."""
    mc = loaded.model_config
    geometry = TorchGeometry(
        mc.num_layers,
        mc.num_heads,
        config.block_size,
        loaded.kv_dtype,
        loaded.model.rotary,
        loaded.device,
    )
    if loaded.device.type != "cpu":
        return TorchBackend(geometry)
    backend = cpu_backend(config.attention_backend, geometry)
    if config.deterministic and not fused_attention_invariant(
        backend, loaded.kv_dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim
    ):
        backend = cpu_backend("torch", geometry)
    return backend


def _make_pool(runner: ModelRunner, kv_pool: torch.Tensor | None) -> KVPool:
    def num_blocks() -> int:
        try:
            return num_blocks_to_allocate(runner)  # on CUDA: runs a profiling forward
        except torch.cuda.OutOfMemoryError as e:
            raise GpuMemoryError(
                f"the profiling forward (one --chunked-prefill-size chunk, --max-num-seqs "
                f"decode rows) ran out of memory on {runner.device}: lower those, or "
                "--max-model-len, or raise --gpu-memory-utilization"
            ) from e

    order = runner.backend.kv_order
    return KVPool.create(
        runner.config, runner.model_config, runner.kv_dtype, num_blocks, kv_pool, order
    )


def num_blocks_to_allocate(runner: ModelRunner) -> int:
    """Pool size when the caller passes no pool: explicit, CPU tokens, or GPU memory."""
    config = runner.config
    wanted = config.num_kv_blocks
    on_cuda = runner.device.type == "cuda"
    if wanted is None:
        if not on_cuda:
            return -(-config.kv_cache_tokens // config.block_size)
        return gpu_kv_blocks(runner)
    if on_cuda and config.gpu_memory_share is not None:
        # A launched worker with a fixed pool (shm staging): it must fit its share too,
        # or it would take memory from the workers it shares the GPU with.
        fits = gpu_kv_blocks(runner)
        if wanted > fits:
            raise GpuMemoryError(
                f"a KV pool of {wanted} blocks does not fit this worker's GPU share "
                f"({fits} blocks): lower --kv-cache-tokens or raise "
                "--gpu-memory-utilization"
            )
    return wanted
