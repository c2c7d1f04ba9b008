"""KV tiers through real launch trees: a prefix evicted from the pools is a tier-2 hit,
survives a SIGTERM (flushed) and a SIGKILL (temp files swept) as a tier-3 hit, with
greedy output identical to its cold run; with 2P/2D on SmolLM2 a prefix one prefill
worker computed is a tier-2 hit on the other. Nothing is left in /dev/shm."""

from __future__ import annotations

import random
import re
import shlex
import signal
from pathlib import Path

import httpx

from tests.conftest import LaunchedServer

SHM = Path("/dev/shm")


def _complete(srv: LaunchedServer, prompt: list[int], model: str) -> tuple[str, int]:
    """(text, cached_tokens) of a greedy 8-token completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _generate(srv: LaunchedServer, ids: list[int], max_tokens: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _ours_in_shm(pid: int) -> list[str]:
    return [p.name for p in SHM.iterdir() if p.name.startswith(f"pdserve.{pid}.")]


def test_an_evicted_prefix_hits_host_ram_then_disk_after_sigterm_and_sigkill(
    tmp_path: Path,
) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 100_000) for _ in range(150)]
    others = [[rng.randrange(1000, 100_000) for _ in range(150)] for _ in range(4)]
    args = [
        *shlex.split("--prefill 1 --decode 1 --device cpu --kv-cache-tokens 256 --kv-offload-dir"),
        str(tmp_path),
        "--served-model-name",
        "m",
    ]
    srv = LaunchedServer(args)
    srv.wait_ready()
    try:
        cold, cached = _complete(srv, prompt, "m")
        assert cached == 0
        for p in others:  # 16-block pools: the prompt's blocks are evicted
            _complete(srv, p, "m")
        assert _complete(srv, prompt, "m") == (cold, 144)  # 9 blocks from tier 2
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'pdserve_kv_tier_hit_blocks_total{tier="host"} 9.0' in metrics, metrics
        assert 'pdserve_kv_tier_written_bytes_total{tier="host"}' in metrics
    finally:
        assert srv.stop() == 0  # SIGTERM: the launcher flushes tier 3
    assert any("KV tier 3 flushed" in line for line in srv.log)
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) == 45 and not list(tmp_path.rglob("*.tmp"))  # 5 prompts x 9 blocks
    assert _ours_in_shm(srv.proc.pid) == []

    srv = LaunchedServer(args)
    srv.wait_ready()
    scan = next(line for line in srv.log if "KV tier 3 at" in line)
    assert "45 block files" in scan
    try:
        assert _complete(srv, prompt, "m") == (cold, 144)  # 9 blocks from tier 3
        for p in others[:2]:  # writes behind, then a kill with a temp file left over
            _complete(srv, p, "m")
        leftover = files[0].with_name(f".{files[0].name}.999999.tmp")
        leftover.write_bytes(b"half a block")
    finally:
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    assert _ours_in_shm(srv.proc.pid) == []

    srv = LaunchedServer(args)
    srv.wait_ready()
    try:
        scan = next(line for line in srv.log if "KV tier 3 at" in line)
        assert re.search(r"; [1-9]\d* temp files removed", scan), scan
        assert not leftover.exists()
        assert _complete(srv, prompt, "m") == (cold, 144)
        # The next turn of a conversation reuses the answer's block the decode worker
        # wrote: 150 + 24 tokens fill blocks 0-9; prefill alone computed 0-8.
        turn1 = [rng.randrange(1000, 100_000) for _ in range(150)]
        answer = _generate(srv, turn1, 24)["output_ids"]
        turn2 = turn1 + answer + [rng.randrange(1000, 100_000) for _ in range(10)]
        assert _generate(srv, turn2, 4)["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    finally:
        assert srv.stop() == 0


def test_a_prefix_one_prefill_worker_computed_is_a_host_ram_hit_on_the_other() -> None:
    """SmolLM2, 2 prefill + 2 decode, round-robin routing: the repeat goes to the other
    prefill worker, whose pool never saw the prefix."""
    rng = random.Random(9)
    prompt = [rng.randrange(1000, 40_000) for _ in range(200)]
    srv = LaunchedServer(
        shlex.split(
            "--prefill 2 --decode 2 --device cpu --router-policy round-robin --kv-cache-tokens 4096 --max-model-len 1024 --served-model-name m"
        ),
        tiny_model=False,
    )
    srv.wait_ready()
    try:
        cold, cached = _complete(srv, prompt, "m")
        assert cached == 0
        assert _complete(srv, prompt, "m") == (cold, 192)  # 12 blocks, all from tier 2
        health = srv.health()
        hits = sorted(
            w["load"]["prefix_hit_tokens"] for w in health["workers"] if w["role"] == "prefill"
        )
        assert hits == [0, 192], health
    finally:
        assert srv.stop() == 0
    assert _ours_in_shm(srv.proc.pid) == []
