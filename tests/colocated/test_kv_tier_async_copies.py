"""The bookkeeping of tiers whose copies run beside the step (a CUDA pool's), on CPU.

``AsyncTieredKV`` is driven here by a copier that does the same copies on its own
thread, each one held back by a gate the test opens: a copy that has not finished is
one the GPU has not run yet. A stored block stays held in the pool and invisible in
tier 2 until its copy is done; a request whose prefix is being copied back is parked
while another keeps streaming; a tier-2 slot reused while copied is a miss with cold
output; an abort waits for the copy before its blocks go back. (Tiny checkpoint; the
streams and events themselves are checked on a GPU by
``tests/engine/test_kv_tiers_cuda.py``.)
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from colocated.llm import LLM
from engine.kv.block_allocator import block_hashes
from engine.kv.tiers.async_tiers import AsyncTieredKV
from tests.colocated.test_kv_tier_async import (
    STREAM,
    _add,
    _finish,
    _parked,
    _step,
    _streams_beside_parked,
)
from tests.colocated.test_kv_tiers import BS, OTHERS, PARAMS, PROMPT, _host, _keys, _llm

N_PROMPT_BLOCKS = len(PROMPT) // BS  # 6


class GatedCopier:
    """Real block copies on one thread, each waiting for ``gate`` (a GPU that has not
    run them yet while it is closed)."""

    def __init__(self, pool: torch.Tensor, slots: np.ndarray) -> None:
        self.pool = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()
        self.slots, self.n = slots, self.pool.shape[1]
        self.gate = threading.Event()
        self.gate.set()
        self._thread = ThreadPoolExecutor(1)

    def _gated(self, copy: list[tuple[np.ndarray, np.ndarray]]) -> Future[None]:
        def run() -> None:
            assert self.gate.wait(60), "the test never opened the gate"
            for dst, src in copy:
                dst[:] = src

        return self._thread.submit(run)

    def order_after_compute(self) -> None:
        pass  # a CPU step has finished writing when it returns

    def to_host(self, pairs: list[tuple[int, int]]) -> Future[None]:
        return self._gated([(self.slots[s, : self.n], self.pool[b]) for b, s in pairs])

    def to_pool(self, pairs: list[tuple[int, int]]) -> Future[None]:
        return self._gated([(self.pool[b], self.slots[s, : self.n]) for s, b in pairs])

    def staging(self, n: int) -> np.ndarray:
        return np.empty((n, self.n), np.uint8)

    def upload(self, row: np.ndarray, block: int) -> None:
        self.pool[block] = row

    def drain(self) -> None:
        """Wait for every copy given so far."""
        self._thread.submit(lambda: None).result(60)


def _async_llm(model: Path, blocks: int = 16) -> tuple[LLM, AsyncTieredKV, GatedCopier]:
    llm = _llm(model, _host(model), blocks=blocks)
    kv = llm.runner.kv
    assert kv.tiers is not None
    copier = GatedCopier(kv.tensor, kv.tiers.host.payload)
    kv.tiers = AsyncTieredKV(kv.tiers.host, None, kv.tiers.namespace, kv.tensor, copier)
    return llm, kv.tiers, copier


@pytest.fixture
def evicted(default_model_path: Path) -> tuple[LLM, AsyncTieredKV, GatedCopier]:
    """An engine on async tiers that ran PROMPT, stored it in tier 2, and had it pushed out
    of the pool by other prompts."""
    llm, tiers, copier = _async_llm(default_model_path)
    llm.generate([PROMPT], PARAMS)
    for p in OTHERS:
        llm.generate([p], PARAMS)
    copier.drain()
    assert llm.runner.kv.allocator.lookup(block_hashes(PROMPT, BS)) == 0
    return llm, tiers, copier


@pytest.fixture(scope="module")
def cold(default_model_path: Path) -> list[int]:
    return _llm(default_model_path, None).generate([PROMPT], PARAMS)[0].output_ids


def test_a_stored_block_stays_held_and_unseen_until_its_copy_is_done(
    default_model_path: Path,
) -> None:
    llm, tiers, copier = _async_llm(default_model_path)
    kv = llm.runner.kv
    copier.gate.clear()
    llm.generate([PROMPT], PARAMS)  # finished: its blocks would all be CACHED now
    held = kv.allocator.num_used
    assert held >= N_PROMPT_BLOCKS  # ... but the copies still reading them hold them
    assert tiers.host.num_valid() == 0  # claimed slots are BEING WRITTEN: no lookup hit
    copier.gate.set()
    copier.drain()
    assert kv.num_free_blocks == kv.num_blocks  # the references come back, nothing leaks
    assert kv.allocator.num_used == 0
    assert tiers.host.num_valid() == held
    kv.allocator.check_invariants()
    # the slots hold the pool's bytes of the blocks they were copied from
    hashes = block_hashes(PROMPT, BS)
    keys = _keys(llm)[:N_PROMPT_BLOCKS]
    tokens = np.asarray(PROMPT[: N_PROMPT_BLOCKS * BS], dtype="<u4").reshape(-1, BS)
    found = tiers.host.lookup(keys, tokens)
    assert len(found) == N_PROMPT_BLOCKS
    for i, f in enumerate(found):
        block = kv.allocator._by_hash[hashes[i]]
        want = kv.tensor[block].view(-1).view(torch.uint8).numpy()
        assert np.array_equal(tiers.host.payload[f.slot, : want.nbytes], want)


def test_a_request_streams_on_while_another_is_copied_back_from_tier_2(
    evicted: tuple[LLM, AsyncTieredKV, GatedCopier], cold: list[int]
) -> None:
    llm, tiers, copier = evicted
    before = tiers.host.counters()
    out: dict[int, list[int]] = {}
    _add(llm, 1, list(range(300, 320)), STREAM)
    while not out.get(1):
        _step(llm, out)
    copier.gate.clear()
    _add(llm, 2, PROMPT, PARAMS)
    _streams_beside_parked(llm, out, streaming=1, parked=2)
    assert tiers.host.counters()["host_hit_blocks"] == before["host_hit_blocks"]  # not yet
    copier.gate.set()
    _finish(llm, out)
    assert out[2] == cold
    c = tiers.host.counters()
    assert c["host_hit_blocks"] - before["host_hit_blocks"] == N_PROMPT_BLOCKS
    llm.runner.kv.allocator.check_invariants()


def test_a_slot_reused_while_it_is_copied_back_is_a_miss_and_output_stays_cold(
    evicted: tuple[LLM, AsyncTieredKV, GatedCopier], cold: list[int]
) -> None:
    llm, tiers, copier = evicted
    before = tiers.host.counters()
    hit_tokens = llm.runner.kv.allocator.stats.hit_tokens
    out: dict[int, list[int]] = {}
    copier.gate.clear()
    _add(llm, 2, PROMPT, PARAMS)
    _step(llm, out)
    assert _parked(llm, 2)
    tiers.host.clear()  # every slot's version moves while the copy is (still) running
    copier.gate.set()
    _finish(llm, out)
    assert out[2] == cold
    c = tiers.host.counters()
    assert c["host_hit_blocks"] == before["host_hit_blocks"]  # a failure is never a hit
    assert llm.runner.kv.allocator.stats.hit_tokens == hit_tokens
    llm.runner.kv.allocator.check_invariants()


def test_a_request_aborted_while_copied_back_gives_back_its_blocks_after_the_copy(
    evicted: tuple[LLM, AsyncTieredKV, GatedCopier],
) -> None:
    llm, _tiers, copier = evicted
    kv = llm.runner.kv
    free_before = kv.num_free_blocks
    copier.gate.clear()
    out: dict[int, list[int]] = {}
    _add(llm, 2, PROMPT, PARAMS)
    _step(llm, out)
    assert _parked(llm, 2) and kv.num_free_blocks == free_before - N_PROMPT_BLOCKS
    opened: list[bool] = []

    def open_gate() -> None:
        opened.append(True)
        copier.gate.set()

    opener = threading.Timer(0.2, open_gate)
    opener.start()
    llm.scheduler.abort(2)  # returns only once the copy into its blocks has run
    assert opened, "the blocks went back while a copy into them was still running"
    opener.join()
    assert not llm.scheduler.has_work and 2 not in out
    assert kv.num_free_blocks == free_before
    kv.allocator.check_invariants()


def test_eight_prompts_through_a_pool_that_holds_two_finish_with_cold_outputs(
    default_model_path: Path,
) -> None:
    """Requests parked on tier-2 copies let later ones take the blocks; when every block is
    then held by partial prefills, the scheduler must settle the finished copies and
    preempt, not wait for reads that are done (this livelocked on a GPU)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (40 + 9 * i,), generator=g).tolist() for i in range(8)]
    want = [o.output_ids for o in _llm(default_model_path, None).generate(prompts, PARAMS)]
    llm, tiers, _copier = _async_llm(default_model_path, blocks=12)
    for _ in range(3):  # the first round stores; the next two load back under pressure
        assert [o.output_ids for o in llm.generate(prompts, PARAMS)] == want
    assert tiers.host.counters()["host_hit_blocks"] > 0
