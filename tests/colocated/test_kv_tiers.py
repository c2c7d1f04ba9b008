"""KV tiers under a real engine (tiny checkpoint, CPU): a prefix evicted from the pool
comes back from host RAM and from disk with the very bytes that were stored and output
equal to a cold run's; damaged or foreign files, other namespaces, a small budget and a
full disk are misses or drops, never wrong output."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from colocated.llm import LLM
from engine.config import EngineConfig, ModelConfig
from engine.kv.block_allocator import block_hashes
from engine.kv.kv_cache import pool_layout
from engine.kv.sequence import Sequence
from engine.kv.tiers.disk_store import HEADER_BYTES, encode_header
from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.keys import chain_keys, root_key
from engine.kv.tiers.persister import Persister
from wire.params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 16


@dataclass
class Host:
    """One host's tier 2 (a fresh segment per instance: a restarted server's is new)."""

    fd: int
    nbytes: int
    store: HostStore


def _host(
    model: Path, dtype: torch.dtype = torch.float32, bs: int = BS, nbytes: int = 16 << 20
) -> Host:
    nb = pool_layout(ModelConfig.from_pretrained(model), 1, bs, dtype).block_nbytes
    g = Geometry.for_budget(nbytes, bs, nb)
    fd, buf = create_segment(g.offsets[3])
    HostStore.format(buf, g)
    return Host(fd, g.offsets[3], HostStore(fd, buf))


def _llm(
    model: Path,
    host: Host | None,
    disk: Path | None = None,
    dtype: str = "float32",
    bs: int = BS,
    blocks: int = 16,
) -> LLM:
    return LLM(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            num_kv_blocks=blocks,
            block_size=bs,
            kv_offload_fd=None if host is None else host.fd,
            kv_offload_nbytes=0 if host is None else host.nbytes,
            kv_offload_dir=None if disk is None else str(disk),
        )
    )


def _prompts(n: int, length: int = 100) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 1000, (length,), generator=g).tolist() for _ in range(n)]


PROMPT, *OTHERS = _prompts(4)  # four 100-token prompts: more than a 16-block pool holds


@pytest.fixture(scope="module")
def cold(default_model_path: Path) -> list[int]:
    return _llm(default_model_path, None).generate([PROMPT], PARAMS)[0].output_ids


def _evict_then_rerun(llm: LLM) -> list[int]:
    """Run PROMPT, push it out of the pool with other prompts, run it again."""
    llm.generate([PROMPT], PARAMS)
    for p in OTHERS:
        llm.generate([p], PARAMS)
    assert llm.runner.kv.allocator.lookup(block_hashes(PROMPT, BS)) == 0, "still in the pool"
    return llm.generate([PROMPT], PARAMS)[0].output_ids


def _pool_block(llm: LLM, i: int) -> np.ndarray:
    """The pool's bytes of PROMPT's block ``i`` (cached there after the last run)."""
    b = llm.runner.kv.allocator._by_hash[block_hashes(PROMPT, BS)[i]]
    return llm.runner.kv.tensor[b].view(-1).view(torch.uint8).numpy().copy()


def _keys(llm: LLM) -> list[bytes]:
    tiers = llm.runner.kv.tiers
    assert tiers is not None
    return chain_keys(root_key(tiers.namespace, None), PROMPT, BS)


def _persist(llm: LLM, budget: int = 1 << 30, min_free: int = 0) -> Persister:
    tiers = llm.runner.kv.tiers
    assert tiers is not None and tiers.disk is not None
    pers = Persister(tiers.host, tiers.disk.root, budget, min_free)
    pers.stop(flush=True)  # never started: writes everything pending here
    return pers


def test_an_evicted_prefix_comes_back_from_host_ram_with_its_stored_bytes(
    default_model_path: Path, cold: list[int]
) -> None:
    host = _host(default_model_path)
    llm = _llm(default_model_path, host)
    assert _evict_then_rerun(llm) == cold
    c = host.store.counters()
    assert c["host_hit_blocks"] == 6  # (100 - 1) // 16 blocks: all but the last token's
    # cached_tokens of the client: the tier hit counts as a prefix hit
    assert llm.runner.kv.allocator.stats.hit_tokens == 96
    for i, key in enumerate(_keys(llm)[:6]):
        (found,) = host.store.lookup([key], np.asarray(PROMPT[i * BS : (i + 1) * BS])[None])
        stored = host.store.payload[found.slot, : host.store.geometry.payload_nbytes]
        assert (_pool_block(llm, i) == stored).all()


def test_a_deferred_store_holds_its_blocks_until_it_copies_the_computed_bytes(
    default_model_path: Path,
) -> None:
    """A worker stores a step's blocks in tier 2 after sending its tokens: meanwhile the
    slots are claimed (a miss for every lookup) and the pool blocks cannot be handed out."""
    host = _host(default_model_path)
    llm = _llm(default_model_path, host)
    kv = llm.runner.kv
    assert kv.defer_tier_stores, "the in-process engine defers as the workers do"
    seq = Sequence(1, list(PROMPT), sampling=PARAMS)
    llm.runner.prefill([(seq, len(PROMPT))])
    keys, rows = _keys(llm)[:6], np.asarray(PROMPT[:96]).reshape(6, BS)
    assert host.store.lookup(keys, rows) == []
    held = seq.block_table[:6]
    expected = [_pool_block(llm, i) for i in range(6)]
    kv.free_blocks(seq)
    taken = kv.allocator.allocate(kv.allocator.num_available)
    assert not set(taken) & set(held), "a block waiting for its store was handed out"
    kv.allocator.free(taken)
    kv.store_offered()
    found = host.store.lookup(keys, rows)
    assert len(found) == 6
    for f, want in zip(found, expected, strict=True):
        assert (host.store.payload[f.slot, : want.nbytes] == want).all()
    assert host.store.counters()["host_stores"] == 6


def test_an_evicted_prefix_comes_back_from_disk_after_a_restart(
    default_model_path: Path, cold: list[int], tmp_path: Path
) -> None:
    first = _llm(default_model_path, _host(default_model_path), tmp_path)
    assert _evict_then_rerun(first) == cold
    pers = _persist(first)
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kvb"))
    assert pers.usage == on_disk > 0
    # "Restart": a new engine with an empty tier 2 and the same directory.
    host = _host(default_model_path)
    again = _llm(default_model_path, host, tmp_path)
    assert again.generate([PROMPT], PARAMS)[0].output_ids == cold
    assert host.store.counters()["disk_hit_blocks"] == 6
    tiers = again.runner.kv.tiers
    assert tiers is not None and tiers.disk is not None
    for i, key in enumerate(_keys(again)[:6]):
        stored = tiers.disk.path(key).read_bytes()[-tiers.block_nbytes :]
        assert _pool_block(again, i).tobytes() == stored
    # The blocks read went on to tier 2 after the load, and their pool blocks were held
    # only until then: every block of the idle pool is free or evictable again.
    tiers.flush()
    found = host.store.lookup(_keys(again)[:6], np.asarray(PROMPT[:96]).reshape(6, BS))
    assert len(found) == 6
    for i, f in enumerate(found):
        in_host = host.store.payload[f.slot, : host.store.geometry.payload_nbytes]
        assert (_pool_block(again, i) == in_host).all()
    assert again.runner.kv.num_free_blocks == again.runner.kv.num_blocks
    # A scan of the directory (a restarted writer) finds the same usage.
    assert _persist(again).usage == sum(p.stat().st_size for p in tmp_path.rglob("*.kvb"))


def _damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "flip":
        path.write_bytes(raw[:-5] + bytes([raw[-5] ^ 0x10]) + raw[-4:])
    elif how == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "magic":
        path.write_bytes(b"GARBAGE!" + raw[8:])
    elif how == "foreign":
        path.write_bytes(os.urandom(len(raw)))
    elif how == "other block":  # an intact file of another block under this name
        path.write_bytes(path.with_name("other").read_bytes())
    elif how == "tokens":  # intact, this block's key and parent, other token ids
        payload = np.frombuffer(raw[-tiny_payload(raw) :], np.uint8)
        ns, key, parent = raw[16:32], raw[32:48], raw[48:64]
        tokens = np.frombuffer(raw[HEADER_BYTES : HEADER_BYTES + 4 * BS], "<u4") + 1
        path.write_bytes(encode_header(ns, key, parent, tokens, payload) + payload.tobytes())


def tiny_payload(raw: bytes) -> int:
    return len(raw) - HEADER_BYTES - 4 * BS


@pytest.mark.parametrize(
    "how", ["flip", "truncate", "empty", "magic", "foreign", "other block", "tokens"]
)
def test_a_damaged_block_file_is_a_miss_from_there_on_and_output_stays_right(
    default_model_path: Path, cold: list[int], tmp_path: Path, how: str
) -> None:
    first = _llm(default_model_path, _host(default_model_path), tmp_path)
    first.generate([PROMPT], PARAMS)
    _persist(first)
    assert first.runner.kv.tiers is not None and first.runner.kv.tiers.disk is not None
    disk = first.runner.kv.tiers.disk
    keys = _keys(first)
    if how == "other block":
        disk.path(keys[2]).with_name("other").write_bytes(disk.path(keys[4]).read_bytes())
    _damage(disk.path(keys[2]), how)
    host = _host(default_model_path)
    again = _llm(default_model_path, host, tmp_path)
    assert again.generate([PROMPT], PARAMS)[0].output_ids == cold
    c = host.store.counters()
    assert (c["disk_hit_blocks"], c["disk_quarantined"]) == (2, 1)  # blocks 0, 1; 2 is bad
    assert not disk.path(keys[2]).exists() and len(list((tmp_path / "quarantine").iterdir())) == 1


@pytest.mark.parametrize(("dtype", "bs"), [("bfloat16", BS), ("float32", 32)])
def test_another_dtype_or_block_size_never_hits_the_files(
    default_model_path: Path, tmp_path: Path, dtype: str, bs: int
) -> None:
    first = _llm(default_model_path, _host(default_model_path), tmp_path)
    first.generate([PROMPT], PARAMS)
    _persist(first)
    want = _llm(default_model_path, None, dtype=dtype, bs=bs).generate([PROMPT], PARAMS)
    host = _host(default_model_path, getattr(torch, dtype), bs)
    other = _llm(default_model_path, host, tmp_path, dtype=dtype, bs=bs)
    assert other.generate([PROMPT], PARAMS)[0].output_ids == want[0].output_ids
    c = host.store.counters()
    assert c["disk_hit_blocks"] == 0 and c["disk_quarantined"] == 0


def test_disk_usage_stays_within_its_budget_and_host_ram_within_its_slots(
    default_model_path: Path, tmp_path: Path
) -> None:
    host = _host(default_model_path, nbytes=256 << 10)  # about 30 blocks
    llm = _llm(default_model_path, host, tmp_path)
    tiers = llm.runner.kv.tiers
    assert tiers is not None and tiers.disk is not None
    budget = 10 * tiers.disk.file_nbytes + 100
    for p in _prompts(12, 120):
        llm.generate([p], PARAMS)
        pers = _persist(llm, budget)
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))
        assert pers.usage == on_disk <= budget + tiers.disk.file_nbytes
    assert host.store.num_valid() <= host.store.geometry.slots
    assert host.store.counters()["host_evictions"] > 0
    assert host.store.counters()["disk_evictions"] > 0


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_drops_blocks_and_serving_goes_on(
    default_model_path: Path, cold: list[int], tiny_tmpfs: Path
) -> None:
    host = _host(default_model_path)
    llm = _llm(default_model_path, host, tiny_tmpfs)
    for p in [PROMPT, *OTHERS]:
        llm.generate([p], PARAMS)
    st = os.statvfs(tiny_tmpfs)
    # Someone else's file leaves room for about one block file (8 KiB of payload).
    (tiny_tmpfs / "filler").write_bytes(b"x" * (st.f_bavail * st.f_frsize - 10_000))
    pers = _persist(llm)  # a 1 GiB budget on a nearly full 64 KiB file system
    c = host.store.counters()
    assert c["disk_dropped"] > 0
    assert pers.usage == sum(f.stat().st_size for f in tiny_tmpfs.rglob("*.kvb"))
    assert not list(tiny_tmpfs.rglob("*.tmp"))
    assert llm.generate([PROMPT], PARAMS)[0].output_ids == cold
