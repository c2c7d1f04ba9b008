"""A request whose prefix is read from tier 3 is parked while the reads run on loader
threads: another request keeps streaming a token every step meanwhile; once the reads
are in, the parked request's output equals a cold run's and its blocks count as hits.
Aborted while parked, its reserved blocks all come back. (Tiny checkpoint, CPU; the
reads are held back by a gate on the real disk reads, not by timing.)"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from colocated.llm import LLM
from engine.kv.tiers.disk_store import DiskStore
from tests.colocated.test_kv_tiers import (
    PARAMS,
    PROMPT,
    _evict_then_rerun,
    _host,
    _llm,
    _persist,
)
from wire.params import SamplingParams
from wire.records import GenerateRequest

STREAM = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cold(default_model_path: Path) -> list[int]:
    return _llm(default_model_path, None).generate([PROMPT], PARAMS)[0].output_ids


@pytest.fixture
def restarted(default_model_path: Path, tmp_path: Path) -> tuple[LLM, threading.Event]:
    """An engine whose tier 3 holds PROMPT's blocks (its tier 2 empty), and the gate its
    disk reads wait on."""
    first = _llm(default_model_path, _host(default_model_path), tmp_path)
    _evict_then_rerun(first)
    _persist(first)
    llm = _llm(default_model_path, _host(default_model_path), tmp_path)
    tiers = llm.runner.kv.tiers
    assert tiers is not None and tiers.disk is not None and tiers.loader is not None
    gate = threading.Event()
    disk: DiskStore = tiers.disk
    real = disk.read

    def gated(key: bytes, parent: bytes, tokens: np.ndarray, out: np.ndarray) -> bool:
        assert gate.wait(60), "the test never opened the gate"
        return real(key, parent, tokens, out)

    disk.read = gated  # type: ignore[method-assign]
    return llm, gate


def _add(llm: LLM, rid: int, prompt: list[int], params: SamplingParams) -> None:
    req = GenerateRequest(rid, list(prompt), params, decode_worker=0, detok_shard=0)
    assert llm.scheduler.add(req) == 0


def _step(llm: LLM, outputs: dict[int, list[int]]) -> None:
    for _, batch in llm.scheduler.step().tokens:
        for rid, token in zip(batch.rids.tolist(), batch.token_ids.tolist(), strict=True):
            outputs.setdefault(rid, []).append(token)


def _parked(llm: LLM, rid: int) -> bool:
    return any(
        p.seq.rid == rid and llm.runner.kv.tier_loading(p.seq)
        for p in llm.scheduler.prefill.waiting
    )


def _finish(llm: LLM, out: dict[int, list[int]]) -> None:
    """Step until the scheduler has no work left."""
    while llm.scheduler.has_work:
        _step(llm, out)


def _streams_beside_parked(
    llm: LLM, out: dict[int, list[int]], streaming: int, parked: int, steps: int = 5
) -> None:
    """For ``steps`` steps ``streaming`` decodes a token every step while ``parked`` waits
    for its tier loads, with no output."""
    for _ in range(steps):
        n = len(out[streaming])
        _step(llm, out)
        assert len(out[streaming]) == n + 1
        assert _parked(llm, parked) and parked not in out


def test_a_request_streams_on_while_another_waits_for_its_disk_blocks(
    restarted: tuple[LLM, threading.Event], cold: list[int]
) -> None:
    llm, gate = restarted
    out: dict[int, list[int]] = {}
    _add(llm, 1, list(range(300, 320)), STREAM)  # 20 tokens: nothing of it is on disk
    while not out.get(1):
        _step(llm, out)
    _add(llm, 2, PROMPT, PARAMS)
    _streams_beside_parked(llm, out, streaming=1, parked=2)
    assert llm.scheduler.prefill.waiting[0].seq.num_cached_tokens == 0  # nothing counted yet
    gate.set()
    _finish(llm, out)
    assert out[2] == cold
    tiers = llm.runner.kv.tiers
    assert tiers is not None
    c = tiers.host.counters()
    # request 1 looked up its one full block: a miss; every block of request 2 a hit
    assert c["disk_hit_blocks"] == 6 and c["disk_miss_blocks"] == 1
    assert llm.runner.kv.allocator.stats.hit_tokens == 96
    llm.runner.kv.allocator.check_invariants()


def test_a_request_aborted_while_parked_gives_back_every_block(
    restarted: tuple[LLM, threading.Event],
) -> None:
    llm, gate = restarted
    alloc = llm.runner.kv.allocator
    free_before = alloc.num_available
    out: dict[int, list[int]] = {}
    _add(llm, 2, PROMPT, PARAMS)
    _step(llm, out)
    assert _parked(llm, 2)
    assert alloc.num_available < free_before  # blocks reserved for the reads
    opener = threading.Timer(0.2, gate.set)  # reads in flight end; those not begun are skipped
    opener.start()
    llm.scheduler.abort(2)
    opener.join()
    assert not llm.scheduler.has_work and 2 not in out
    assert alloc.num_available == free_before
    alloc.check_invariants()
    tiers = llm.runner.kv.tiers
    assert tiers is not None and tiers.host.counters()["disk_hit_blocks"] == 0
