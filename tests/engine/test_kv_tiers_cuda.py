"""KV tiers on a real GPU: tier 2 page-locked, copies on a side stream ordered against the
compute stream, loads off the step, and output unchanged. Skipped without CUDA (the
bookkeeping is tested on CPU by ``tests/colocated/test_kv_tier_async_copies.py``).

Ordering is checked with ``torch.cuda._sleep``: the compute stream is kept busy, then
given a write (or a read) of a block; a copy started after that must see the write
(must not overwrite the block before the read), however long the compute stream takes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from colocated.llm import LLM
from engine.config import EngineConfig
from engine.kv.block_allocator import block_hashes
from engine.kv.tiers.async_tiers import AsyncTieredKV
from engine.kv.tiers.cuda_copy import CudaCopier
from tests.colocated.test_kv_tiers import (
    BS,
    PARAMS,
    PROMPT,
    Host,
    _evict_then_rerun,
    _host,
    _keys,
    _persist,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
BUSY = 2_000_000_000  # GPU cycles of torch.cuda._sleep: about a second on any GPU
N_PROMPT_BLOCKS = len(PROMPT) // BS


def _llm(model: Path, host: Host | None, disk: Path | None = None, blocks: int = 16) -> LLM:
    return LLM(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cuda",
            num_kv_blocks=blocks,
            block_size=BS,
            kv_offload_fd=None if host is None else host.fd,
            kv_offload_nbytes=0 if host is None else host.nbytes,
            kv_offload_dir=None if disk is None else str(disk),
        )
    )


def _tiers(llm: LLM) -> AsyncTieredKV:
    tiers = llm.runner.kv.tiers
    assert isinstance(tiers, AsyncTieredKV)
    return tiers


def _copier(llm: LLM) -> CudaCopier:
    copier = _tiers(llm).copier
    assert isinstance(copier, CudaCopier)
    return copier


@pytest.fixture(scope="module")
def cold(default_model_path: Path) -> list[int]:
    return _llm(default_model_path, None).generate([PROMPT], PARAMS)[0].output_ids


def test_tier_2_is_page_locked(default_model_path: Path) -> None:
    copier = _copier(_llm(default_model_path, _host(default_model_path)))
    assert copier.slot_rows.is_pinned()


def test_a_prefix_spilled_to_host_ram_and_back_gives_the_cold_output_and_bytes(
    default_model_path: Path, cold: list[int]
) -> None:
    llm = _llm(default_model_path, _host(default_model_path))
    assert _evict_then_rerun(llm) == cold
    tiers = _tiers(llm)
    assert tiers.host.counters()["host_hit_blocks"] == N_PROMPT_BLOCKS
    kv = llm.runner.kv
    tokens = np.asarray(PROMPT[: N_PROMPT_BLOCKS * BS], dtype="<u4").reshape(-1, BS)
    keys = _keys(llm)[:N_PROMPT_BLOCKS]
    for i, f in enumerate(tiers.host.lookup(keys, tokens)):
        block = kv.allocator._by_hash[block_hashes(PROMPT, BS)[i]]
        want = kv.tensor[block].view(-1).view(torch.uint8).cpu().numpy()
        assert np.array_equal(tiers.host.payload[f.slot, : want.nbytes], want)
    kv.allocator.check_invariants()


def test_a_prefix_spilled_to_disk_comes_back_after_a_restart_unchanged(
    default_model_path: Path, cold: list[int], tmp_path: Path
) -> None:
    first = _llm(default_model_path, _host(default_model_path), tmp_path)
    _evict_then_rerun(first)
    _tiers(first).flush()  # every store copy published: the persister sees them all
    _persist(first)
    again = _llm(default_model_path, _host(default_model_path), tmp_path)  # tier 2 empty
    assert again.generate([PROMPT], PARAMS)[0].output_ids == cold
    c = _tiers(again).host.counters()
    assert c["disk_hit_blocks"] == N_PROMPT_BLOCKS and c["host_hit_blocks"] == 0
    again.runner.kv.allocator.check_invariants()


def test_round_trips_under_load_leave_every_output_unchanged(default_model_path: Path) -> None:
    """Eight prompts in one batch through a pool that holds two: every round trip goes
    through tier 2 while the others step."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (40 + 9 * i,), generator=g).tolist() for i in range(8)]
    want = [
        o.output_ids for o in _llm(default_model_path, None, blocks=64).generate(prompts, PARAMS)
    ]
    llm = _llm(default_model_path, _host(default_model_path), blocks=12)
    for _ in range(3):
        assert [o.output_ids for o in llm.generate(prompts, PARAMS)] == want
    assert _tiers(llm).host.counters()["host_hit_blocks"] > 0
    llm.runner.kv.allocator.check_invariants()


@pytest.fixture
def copier(default_model_path: Path) -> CudaCopier:
    return _copier(_llm(default_model_path, _host(default_model_path)))


def test_a_store_waits_for_the_step_writing_its_block(copier: CudaCopier) -> None:
    torch.cuda._sleep(BUSY)
    copier.pool_rows[3].fill_(7)  # the "step": queued behind the sleep
    copied = copier.to_host([(3, 5)])
    assert not copied.done()  # the host did not wait for the compute stream
    copied.result(60)
    assert (copier.slot_rows[5, : copier.block_nbytes] == 7).all()


def test_a_load_never_overwrites_a_block_a_queued_step_still_reads(copier: CudaCopier) -> None:
    copier.pool_rows[4].fill_(1)
    copier.slot_rows[6, : copier.block_nbytes].fill_(2)
    torch.cuda._sleep(BUSY)
    seen = copier.pool_rows[4].clone()  # the "step" reading the block, queued
    copier.to_pool([(6, 4)]).result(60)
    torch.cuda.synchronize()
    assert (seen == 1).all() and (copier.pool_rows[4] == 2).all()


def test_a_tier_3_upload_from_a_loader_thread_waits_for_the_reservations_step(
    copier: CudaCopier,
) -> None:
    copier.pool_rows[2].fill_(1)
    torch.cuda._sleep(BUSY)
    seen = copier.pool_rows[2].clone()
    copier.order_after_compute()  # taken when the block is reserved
    row = copier.staging(1)[0]
    row[:] = 9
    t = threading.Thread(target=copier.upload, args=(row, 2))
    t.start()
    t.join(60)
    torch.cuda.synchronize()
    assert (seen == 1).all() and (copier.pool_rows[2] == 9).all()
