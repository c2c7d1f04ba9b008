"""One engine worker's ``EngineConfig`` from the server's settings, in one place.

Every ``EngineConfig`` field that ``ServerConfig`` has by the same name is copied as it is:
an engine setting added to both (and to ``launcher/flags.py``) reaches the workers with no
line here. The fields the launcher sets otherwise are listed in ``SET_HERE``, each with
why; the engine's other fields (``seed``, ``num_kv_blocks``, ...) keep their defaults
unless the caller passes them (the KV tiers' segment, the weights segment).
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from launcher.placement import WorkerPlace
from launcher.settings import ServerConfig
from wire.roles import Role

# EngineConfig fields not copied from the ServerConfig field of the same name, and why.
SET_HERE: dict[str, str] = {
    "model": "the checkpoint resolved from --model (a .gguf or the default, converted)",
    "dtype": "the DType enum's value",
    "device": "the worker's placement: cpu, or the one GPU it sees",
    "gpu_memory_share": "the worker's placement: its fraction of a shared GPU",
    "large_batch_gemm": "always on in served workers",
    "max_loras": "0 unless --enable-lora",
    "speculative": "--speculative-config, on decode and co-located workers only",
    "kv_offload_dir": "the KV tiers' own directory under it, when the tiers are on",
}


def engine_config(
    config: ServerConfig, model: Path, place: WorkerPlace, given: dict[str, Any]
) -> EngineConfig:
    """The engine settings of the worker at ``place``; ``given``: fields the caller sets
    (the KV tiers', the weights segment's), which win over everything else."""
    assert config.kv_cache_tokens is not None, "sized by the memory plan (size_kv)"
    same = {
        f.name: getattr(config, f.name)
        for f in fields(EngineConfig)
        if f.name not in SET_HERE and hasattr(config, f.name)
    }
    engine = EngineConfig(
        **same,
        model=str(model),
        dtype=config.dtype.value,
        device=place.device,
        gpu_memory_share=place.gpu_memory_share,  # None on CPU
        # Packed layers also hold a bfloat16 GEMM for calls of many rows, in every role:
        # prefill chunks, and decode batches past the crossover measured at load.
        large_batch_gemm=True,
        max_loras=config.max_loras if config.enable_lora else 0,
    )
    engine = replace(engine, **given)
    if place.role in (Role.DECODE, Role.COLOCATED):  # prefill workers never speculate
        engine = replace(engine, speculative=config.speculative_config)
    return engine
