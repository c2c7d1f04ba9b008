"""A restart keeps what tier 3 promised on a model the fused CPU ops serve.

The tiny Qwen3 checkpoint has a head size of 32, which the kernel library's attention
takes, so its engine workers write blocks in the library's order (``vec16``), as SmolLM2's
do; the tiny Qwen2's 16 keep ``tests/e2e/test_kv_tiers.py`` on the torch path. The same
prompt after a SIGTERM and a restart with the same ``--kv-offload-dir`` must come from
tier 3, whose writer (the launcher, which never loads the kernels) filed the blocks
under the name the workers look them up by. One disaggregated server on the safetensors
checkpoint, one co-located on a GGUF of it.
"""

from __future__ import annotations

import random
import re
import shlex
from pathlib import Path

import httpx
import pytest

from bundled_models import tiny
from engine.kernels.vllm_cpu import available
from tests.conftest import LaunchedServer

pytestmark = pytest.mark.skipif(
    available() is None, reason="the fused CPU ops do not load here: nothing vec16 to check"
)


def _tiny_qwen3_gguf() -> Path:
    """A GGUF of the tiny Qwen3 (with its vocabulary), written once into the cache: a
    fixed path, so the launcher's conversion of it is cached too."""
    from tests.engine.gguf_files import write_gguf

    def build(out: Path) -> None:
        write_gguf(tiny.tiny_model_dir("qwen3"), out / "tiny-qwen3.gguf")

    built = tiny.atomic_build(tiny.cache_root() / f"tiny-qwen3-gguf-v{tiny.FIXTURE_VERSION}", build)
    return built / "tiny-qwen3.gguf"


def _complete(srv: LaunchedServer, prompt: list[int]) -> tuple[str, int]:
    """(text, cached_tokens) of a greedy 8-token completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _disk_hits(srv: LaunchedServer) -> float:
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(r'^pdserve_kv_tier_hit_blocks_total\{tier="disk"\} (\S+)$', metrics, re.M)
    assert m is not None, metrics
    return float(m.group(1))


@pytest.mark.parametrize(
    ("topology", "checkpoint"),
    [("--prefill 1 --decode 1", "safetensors"), ("--colocated 1", "gguf")],
)
def test_a_prompt_in_tier3_is_a_hit_after_a_restart_on_the_fused_cpu_ops(
    tmp_path: Path, topology: str, checkpoint: str
) -> None:
    model = tiny.tiny_model_dir("qwen3") if checkpoint == "safetensors" else _tiny_qwen3_gguf()
    args = [
        "--model",
        str(model),
        *shlex.split(topology),
        *shlex.split("--device cpu --kv-cache-tokens 512 --served-model-name m"),
        "--kv-offload-dir",
        str(tmp_path),
    ]
    rng = random.Random(11)
    prompt = [rng.randrange(1000, 100_000) for _ in range(150)]
    srv = LaunchedServer(args)
    srv.wait_ready()
    try:
        assert any("fused CPU ops: " in line for line in srv.log), "".join(srv.log[-40:])
        cold, cached = _complete(srv, prompt)
        assert cached == 0
    finally:
        assert srv.stop() == 0  # SIGTERM: the launcher flushes tier 3
    assert len(list(tmp_path.rglob("*.kvb"))) == 9  # 150 tokens: 9 full blocks of 16

    srv = LaunchedServer(args)
    srv.wait_ready()
    try:
        assert "9 block files" in next(line for line in srv.log if "KV tier 3 at" in line)
        assert _complete(srv, prompt) == (cold, 144)  # the pools are empty: all 9 from disk
        assert _disk_hits(srv) == 9
    finally:
        assert srv.stop() == 0
