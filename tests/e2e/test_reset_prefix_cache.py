"""POST /reset_prefix_cache through a real launch tree with both KV tiers on: behind the
API key; once answered, the same prompt is a miss in the pools, tier 2 and tier 3 (its
files are gone) and its greedy output is unchanged; the cache then fills again."""

from __future__ import annotations

import random
import shlex
import time
from pathlib import Path

import httpx

from tests.conftest import LaunchedServer

KEY = {"Authorization": "Bearer s3cret"}


def _complete(srv: LaunchedServer, prompt: list[int]) -> tuple[str, int]:
    """(text, cached_tokens) of a greedy 8-token completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=KEY, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _files(root: Path) -> list[Path]:
    return list(root.rglob("*.kvb"))


def test_a_reset_empties_every_pool_and_tier_and_outputs_stay_the_same(tmp_path: Path) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(1000, 100_000) for _ in range(150)]
    args = [
        *shlex.split("--prefill 1 --decode 1 --device cpu --kv-cache-tokens 512 --kv-offload-dir"),
        str(tmp_path),
        *shlex.split("--served-model-name m --api-key s3cret"),
    ]
    srv = LaunchedServer(args)
    srv.wait_ready()
    try:
        cold, cached = _complete(srv, prompt)
        assert cached == 0
        assert _complete(srv, prompt) == (cold, 144)  # 9 blocks from the prefill pool
        deadline = time.monotonic() + 30
        while len(_files(tmp_path)) < 9 and time.monotonic() < deadline:
            time.sleep(0.1)  # tier 3 is written behind
        assert len(_files(tmp_path)) >= 9

        r = httpx.post(srv.url + "/reset_prefix_cache", timeout=60)
        assert r.status_code == 401, r.text
        r = httpx.post(srv.url + "/reset_prefix_cache", headers=KEY, timeout=60)
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["reset"] and done["workers"] == 2 and done["disk_cleared"], done
        assert done["host_blocks_dropped"] >= 9, done
        assert _files(tmp_path) == []

        assert _complete(srv, prompt) == (cold, 0)  # a miss in every tier, same output
        metrics = httpx.get(srv.url + "/metrics", headers=KEY, timeout=10).text
        assert 'pdserve_kv_tier_hit_blocks_total{tier="host"} 0.0' in metrics, metrics
        assert 'pdserve_kv_tier_hit_blocks_total{tier="disk"} 0.0' in metrics, metrics
        assert _complete(srv, prompt) == (cold, 144)  # and the cache fills again
    finally:
        assert srv.stop() == 0
