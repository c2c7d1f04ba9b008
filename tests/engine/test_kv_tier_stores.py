"""The tier stores on their own: tier 2's shared-memory slots under eviction, concurrent
processes and a racing reader; tier 3's files under every kind of damage and many writers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kv.tiers.disk_store import HEADER_BYTES, QUARANTINE, DiskStore
from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.keys import Namespace, chain_keys, root_key, weights_fingerprint

BS, NBYTES = 4, 4096
NS = Namespace("w", "torch.float32", BS, "(2, 2, 4, 2, 64)").digest


def _store(slots: int, nbytes: int = NBYTES) -> tuple[HostStore, int]:
    g = Geometry(slots, BS, nbytes)
    fd, buf = create_segment(g.offsets[3])
    HostStore.format(buf, g)
    return HostStore(fd, buf), fd


def _block(i: int, nbytes: int = NBYTES) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    """Block ``i`` of a test chain: key, parent, tokens, payload (every byte ``i % 251``)."""
    tokens = np.arange(i * BS, (i + 1) * BS, dtype="<u4")
    parent = root_key(NS, None) if i == 0 else bytes([i % 256]) * 16
    key = chain_keys(parent, tokens.tolist(), BS)[0]
    return key, parent, tokens, np.full(nbytes, i % 251, dtype=np.uint8)


def test_blocks_come_back_and_the_least_recently_used_is_evicted() -> None:
    store, _ = _store(slots=3)
    blocks = [_block(i) for i in range(4)]
    for key, parent, tokens, payload in blocks[:3]:
        assert store.put(key, parent, tokens, payload)
    assert not store.put(*blocks[0])  # held already
    store.lookup([blocks[0][0]], blocks[0][2][None])  # block 0 is now the most recent
    store.put(*blocks[3])  # evicts block 1, the least recently used
    assert [store.contains(b[0]) for b in blocks] == [True, False, True, True]
    found = store.lookup([b[0] for b in blocks[2:]], np.stack([b[2] for b in blocks[2:]]))
    assert len(found) == 2 and store.still_valid(found) == 2
    assert all(
        (store.payload[f.slot, :NBYTES] == b[3]).all()
        for f, b in zip(found, blocks[2:], strict=True)
    )
    assert store.counters()["host_evictions"] == 1 and store.num_valid() <= 3


def test_a_lookup_takes_the_leading_run_and_checks_token_ids() -> None:
    store, _ = _store(slots=8)
    blocks = [_block(i) for i in range(4)]
    for b in (blocks[0], blocks[1], blocks[3]):
        store.put(*b)
    keys, tokens = [b[0] for b in blocks], np.stack([b[2] for b in blocks])
    assert len(store.lookup(keys, tokens)) == 2  # block 2 is missing: 3 does not count
    other = tokens.copy()
    other[0, 0] += 1  # the same key, other token ids: never a hit
    assert store.lookup(keys, other) == []


def test_a_reader_whose_slot_is_reused_while_it_copies_gets_a_miss() -> None:
    store, _ = _store(slots=1)
    a, b = _block(1), _block(2)
    store.put(*a)
    found = store.lookup([a[0]], a[2][None])
    copy = store.payload[found[0].slot, :NBYTES].copy()
    store.put(*b)  # evicts a: same slot, new bytes
    assert store.still_valid(found) == 0  # what was copied must not be used
    assert (copy == a[3]).all()


def test_clear_forgets_every_block_and_drops_writes_in_flight() -> None:
    store, _ = _store(slots=4)
    for i in range(3):
        store.put(*_block(i))
    assert store.clear() == 3 and store.num_valid() == 0
    assert not any(store.contains(_block(i)[0]) for i in range(3))
    assert store.put(*_block(0)) and store.contains(_block(0)[0])


_RACER = """
import os, sys, numpy as np
sys.path.insert(0, {root!r})
import mmap
from engine.kv.tiers.host_store import HostStore
from tests.engine.test_kv_tier_stores import _block
fd, nbytes, first, n = (int(a) for a in sys.argv[1:5])
store = HostStore(fd, memoryview(mmap.mmap(fd, nbytes, mmap.MAP_SHARED)))
for r in range(n):
    i = first + r % 5
    store.put(*_block(i, {nbytes}))
"""


def _racer(fd: int, total: int, first: int, n: int, nbytes: int) -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parents[2])
    code = textwrap.dedent(_RACER).format(root=root, nbytes=nbytes)
    args = [sys.executable, "-c", code, str(fd), str(total), str(first), str(n)]
    return subprocess.Popen(args, pass_fds=[fd], env={**os.environ, "PYTHONPATH": root})


def test_readers_racing_writers_in_other_processes_never_see_wrong_bytes() -> None:
    """Two writer processes keep evicting each other's blocks from 3 slots while this
    process reads, slowly (a pause mid-copy widens the race): every read it accepts holds
    exactly the block it asked for, and reads whose slot was reused are refused."""
    nbytes = 1 << 20  # long copies: a writer often reuses the slot mid-copy
    store, fd = _store(slots=3, nbytes=nbytes)
    total = store.geometry.offsets[3]
    writers = [_racer(fd, total, first, 400, nbytes) for first in (0, 100)]
    accepted = missed = 0
    try:
        while any(w.poll() is None for w in writers):
            for i in (*range(5), *range(100, 105)):
                key, _, tokens, want = _block(i, nbytes)
                found = store.lookup([key], tokens[None])
                if not found:
                    missed += 1
                    continue
                half = nbytes // 2
                got = store.payload[found[0].slot, :half].copy()
                time.sleep(0.002)
                got = np.concatenate([got, store.payload[found[0].slot, half:nbytes]])
                if store.still_valid(found) == 1:
                    assert (got == want).all(), f"block {i}: accepted bytes of another block"
                    accepted += 1
                else:
                    missed += 1
    finally:
        codes = [w.wait(60) for w in writers]
    assert codes == [0, 0]
    assert missed > 0 and accepted > 0
    assert store.num_valid() <= 3


# ---- tier 3 ------------------------------------------------------------------------


def _disk(root: Path, ns: bytes = NS) -> DiskStore:
    return DiskStore(root, ns, BS, NBYTES)


def test_a_block_file_round_trips_and_names_its_block(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    key, parent, tokens, payload = _block(3)
    assert disk.write(key, parent, tokens, payload) == disk.file_nbytes
    assert disk.write(key, parent, tokens, payload) == 0  # there already
    out = np.empty(NBYTES, np.uint8)
    assert disk.read(key, parent, tokens, out) and (out == payload).all()
    assert disk.path(key).name == key.hex() + ".kvb" and NS.hex() in str(disk.path(key))
    assert disk.path(key).stat().st_size == disk.file_nbytes
    assert not list(tmp_path.rglob("*.tmp"))


def _flip_payload(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 0x01
    p.write_bytes(bytes(raw))


DAMAGE = {
    "flipped payload byte": _flip_payload,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-10]),
    "truncated header": lambda p: p.write_bytes(p.read_bytes()[: HEADER_BYTES // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "bad magic": lambda p: p.write_bytes(b"XXXX" + p.read_bytes()[4:]),
    "foreign file": lambda p: p.write_bytes(os.urandom(5000)),
    "trailing bytes": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_is_a_miss_moved_aside_and_counted(tmp_path: Path, damage: str) -> None:
    disk = _disk(tmp_path)
    key, parent, tokens, payload = _block(5)
    disk.write(key, parent, tokens, payload)
    DAMAGE[damage](disk.path(key))
    assert not disk.read(key, parent, tokens, np.empty(NBYTES, np.uint8))
    assert not disk.path(key).exists()
    assert len(list((tmp_path / QUARANTINE).iterdir())) == 1 and disk.quarantined == 1


def test_a_file_of_other_tokens_or_another_namespace_is_never_a_hit(tmp_path: Path) -> None:
    key, parent, tokens, payload = _block(7)
    other_ns = Namespace("w", "torch.bfloat16", BS, "(2, 2, 4, 2, 64)").digest
    foreign = _disk(tmp_path, other_ns)
    foreign.write(key, parent, tokens, payload)
    mine = _disk(tmp_path)
    # Another namespace lives in another directory: not even found ...
    assert not mine.read(key, parent, tokens, np.empty(NBYTES, np.uint8))
    # ... and a file copied across is refused by its header.
    mine.path(key).parent.mkdir(parents=True)
    foreign.path(key).rename(mine.path(key))
    assert not mine.read(key, parent, tokens, np.empty(NBYTES, np.uint8))
    mine.write(key, parent, tokens, payload)
    assert not mine.read(key, parent, tokens + 1, np.empty(NBYTES, np.uint8))  # token ids
    assert mine.quarantined == 2


def test_every_part_of_the_namespace_changes_it(tmp_path: Path, default_model_path: Path) -> None:
    base = Namespace(weights_fingerprint(default_model_path), "torch.float32", 16, "(2,)")
    import shutil

    other = tmp_path / "other"
    shutil.copytree(default_model_path, other)
    weights = next(other.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one weight byte
    weights.write_bytes(bytes(raw))
    variants = [
        Namespace(weights_fingerprint(other), "torch.float32", 16, "(2,)"),
        Namespace(base.weights, "torch.bfloat16", 16, "(2,)"),
        Namespace(base.weights, "torch.float32", 32, "(2,)"),
        Namespace(base.weights, "torch.float32", 16, "(3,)"),
    ]
    assert len({base.digest, *(v.digest for v in variants)}) == 5
    # The adapter salt (a sequence's ``extra``) changes every key of the chain.
    tokens = list(range(32))
    assert (
        chain_keys(root_key(base.digest, b"a"), tokens, 16)[1]
        != chain_keys(root_key(base.digest, None), tokens, 16)[1]
    )


_DISK_WRITER = """
import sys, numpy as np
sys.path.insert(0, {root!r})
from pathlib import Path
from tests.engine.test_kv_tier_stores import _block, _disk
disk = _disk(Path(sys.argv[1]))
for i in range(60):
    disk.write(*_block(i))
"""


def test_processes_writing_the_same_blocks_at_once_leave_one_intact_file_each(
    tmp_path: Path,
) -> None:
    root = str(Path(__file__).resolve().parents[2])
    code = textwrap.dedent(_DISK_WRITER).format(root=root)
    env = {**os.environ, "PYTHONPATH": root}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env) for _ in range(4)
    ]
    assert [p.wait(120) for p in procs] == [0] * 4
    disk = _disk(tmp_path)
    assert len(list(tmp_path.rglob("*.kvb"))) == 60 and not list(tmp_path.rglob("*.tmp"))
    out = np.empty(NBYTES, np.uint8)
    for i in range(60):
        key, parent, tokens, payload = _block(i)
        assert disk.read(key, parent, tokens, out) and (out == payload).all()


def test_blocks_in_the_fused_backends_order_have_a_namespace_of_their_own(
    default_model_path: Path, tmp_path: Path
) -> None:
    """A worker on the fused CPU ops writes its blocks in the kernel library's order: a
    tier shared with (or a restart into) a torch-backend worker must never hand them over.
    The first worker's namespace is the host's (tier 2's header): tier 3's writer files
    blocks under it, and a worker of another order stays off the tiers."""
    from engine.config import EngineConfig
    from engine.kv.kv_cache import layout_of
    from engine.kv.tiers.keys import block_namespace
    from engine.kv.tiers.open_tiers import open_tiers
    from engine.kv.tiers.persister import Persister

    pool = torch.zeros(4, 2, 2, 16, 2, 16)
    weights = weights_fingerprint(default_model_path)
    spaces = {o: block_namespace(weights, layout_of(pool, o)) for o in ("tokens", "vec16")}
    assert spaces["tokens"] != spaces["vec16"]
    # "tokens" blocks keep the namespace they had before the order was part of it.
    assert spaces["tokens"] == Namespace(weights, "torch.float32", 16, "(2, 2, 16, 2, 16)").digest
    nbytes = pool[0].numel() * pool.element_size()
    g = Geometry.for_budget(1 << 20, 16, nbytes)
    for first, second in (("vec16", "tokens"), ("tokens", "vec16")):
        fd, buf = create_segment(g.offsets[3])
        HostStore.format(buf, g)
        host = HostStore(fd, buf)
        config = EngineConfig(
            model=str(default_model_path),
            kv_offload_fd=fd,
            kv_offload_nbytes=g.offsets[3],
            kv_offload_dir=str(tmp_path),
        )
        writer = Persister(host, tmp_path, 1 << 30, 0)
        assert writer.disk is None  # no worker has named the blocks yet
        tiers = open_tiers(config, pool, first)
        assert tiers is not None and tiers.disk is not None
        assert tiers.namespace == spaces[first] == host.namespace
        assert writer.disk is not None and writer.disk.dir == tiers.disk.dir
        assert open_tiers(config, pool, second) is None
        os.close(fd)
