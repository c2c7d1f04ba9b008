"""A worker's EngineConfig comes from the server's settings in one place: every field both
have by name is copied, the rest are set from the worker's place and role."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from engine.config import EngineConfig, SpeculativeConfig
from launcher.engine_config import SET_HERE, engine_config
from launcher.placement import WorkerPlace
from launcher.settings import DType, ServerConfig
from wire.roles import Role

CPU = WorkerPlace(Role.PREFILL, 0, None, None)


def _server(**kw: object) -> ServerConfig:
    return replace(ServerConfig(), kv_cache_tokens=4096, **kw)  # type: ignore[arg-type]


def test_every_setting_of_the_same_name_reaches_the_engine(tmp_path: Path) -> None:
    config = _server(
        block_size=32,
        max_num_seqs=7,
        chunked_prefill_size=96,
        max_model_len=512,
        gemm_min_rows=12,
        gemm_inputs="int8",
        quantization="int4",
        mixed_batches=True,
        enable_prefix_caching=False,
        attention_backend="torch",
        enforce_eager=True,
        max_lora_rank=8,
        gpu_memory_utilization=0.5,
    )
    engine = engine_config(config, tmp_path, CPU, {})
    shared = [f.name for f in fields(EngineConfig) if hasattr(config, f.name)]
    copied = [n for n in shared if n not in SET_HERE]
    assert "block_size" in copied and "mixed_batches" in copied
    for name in copied:
        assert getattr(engine, name) == getattr(config, name), name
    assert engine.kv_cache_tokens == 4096 and engine.enforce_eager


def test_the_fields_set_here_come_from_the_place_and_the_role(tmp_path: Path) -> None:
    assert set(SET_HERE) <= {f.name for f in fields(EngineConfig)}  # no stale exception
    speculative = SpeculativeConfig(num_speculative_tokens=3)
    config = _server(dtype=DType.FLOAT32, max_loras=4, speculative_config=speculative)
    prefill = engine_config(config, tmp_path / "m", CPU, {})
    assert (prefill.model, prefill.dtype, prefill.device) == (str(tmp_path / "m"), "float32", "cpu")
    assert prefill.large_batch_gemm and prefill.gpu_memory_share is None
    assert prefill.max_loras == 0  # no --enable-lora
    assert prefill.speculative is None  # prefill workers never speculate
    gpu = WorkerPlace(Role.DECODE, 1, 0, 0.4)
    decode = engine_config(replace(config, enable_lora=True), tmp_path, gpu, {})
    assert (decode.device, decode.gpu_memory_share) == ("cuda", 0.4)
    assert decode.max_loras == 4 and decode.speculative == speculative


def test_the_callers_fields_win(tmp_path: Path) -> None:
    config = _server(kv_offload_dir=tmp_path / "tiers")
    off = engine_config(config, tmp_path, CPU, {})
    assert off.kv_offload_dir is None  # the tiers' own directory, only when they are on
    given = {"kv_offload_fd": 5, "kv_offload_nbytes": 1 << 20, "kv_offload_dir": "/x/y"}
    on = engine_config(config, tmp_path, CPU, {**given, "weights_fd": 7})
    assert (on.kv_offload_fd, on.kv_offload_nbytes, on.kv_offload_dir) == (5, 1 << 20, "/x/y")
    assert on.weights_fd == 7
