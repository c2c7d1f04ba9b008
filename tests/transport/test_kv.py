"""KV handoff: random non-contiguous block sets arrive byte-identical, pins are released."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys

import pytest
import torch

from tests.transport.kv_peer import expected_pool
from tests.transport.ring_peer import REPO, ring_fds
from transport.doorbell import Doorbell
from transport.errors import KVTransferError
from transport.kv import (
    KVLayout,
    KVReceiver,
    PinnedBlocks,
    block_runs,
    create_pool_segment,
    pool_view,
)
from transport.kv_backends import CudaIpcReceiver, ShmReceiver, register_host_memory
from transport.ring import Ring
from wire import records

LAYOUT = KVLayout(num_blocks=64, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_block_runs_coalesce_only_runs_contiguous_on_both_sides() -> None:
    runs = list(block_runs([3, 4, 5, 9, 10, 2], [7, 8, 1, 2, 3, 0]))
    assert runs == [(3, 7, 2), (5, 1, 1), (9, 2, 2), (2, 0, 1)]
    with pytest.raises(KVTransferError):
        list(block_runs([1, 2], [3]))


def test_pinned_blocks_are_returned_once_on_release() -> None:
    pinned = PinnedBlocks()
    pinned.pin(1, decode_worker=0, blocks=[5, 2])
    pinned.pin(2, decode_worker=1, blocks=[7])
    with pytest.raises(ValueError):
        pinned.pin(1, decode_worker=0, blocks=[9])
    assert pinned.num_pinned == 3
    assert pinned.on_release(1) == [5, 2]
    assert pinned.on_release(1) == []  # a duplicate release frees nothing twice
    assert pinned.on_peer_dead(1) == [7]
    assert pinned.num_pinned == 0


def test_fetch_with_bad_block_ids_raises_and_copies_nothing() -> None:
    src = expected_pool(LAYOUT)
    dst = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
    receiver = ShmReceiver({0: src}, dst)
    for src_blocks, dst_blocks in (([1, 2], [3]), ([1], [64]), ([1, 1], [2, 3])):
        with pytest.raises(KVTransferError):
            receiver.fetch(0, src_blocks, dst_blocks)
    with pytest.raises(KVTransferError):
        receiver.fetch(5, [1], [1])
    assert not dst.any()


@pytest.mark.parametrize("head_dim", [128, 101])  # 256 KiB blocks; odd-sized blocks
def test_large_block_runs_copy_byte_identical(head_dim: int) -> None:
    layout = KVLayout(24, 4, 16, 8, head_dim, "float16")  # runs take the streaming path
    seg = create_pool_segment(f"large-{head_dim}", layout)
    src = pool_view(seg, layout)
    src.copy_(torch.randn(layout.shape).to(torch.float16))
    dst = torch.zeros(layout.shape, dtype=torch.float16)
    rng = random.Random(head_dim)
    for _ in range(5):
        n = rng.randint(1, 10)
        src_blocks = sorted(rng.sample(range(24), n))  # sorted: long contiguous runs too
        dst_blocks = sorted(rng.sample(range(24), n))
        ShmReceiver({0: src}, dst).fetch(0, src_blocks, dst_blocks)
        assert torch.equal(dst[dst_blocks].view(torch.uint8), src[src_blocks].view(torch.uint8))


def _run_decode_side(backend: str, n: int, device: str) -> None:
    """Be decode worker 0 for a real prefill child; check every fetched block's bytes."""
    seg = create_pool_segment(f"test-{backend}", LAYOUT)
    bell_p, bell_d = Doorbell.create(), Doorbell.create()
    to_decode = Ring.create(f"kv-{backend}-p2d", 1 << 16, bell_d)
    to_prefill = Ring.create(f"kv-{backend}-d2p", 1 << 12, bell_p)
    inbound = Ring.attach(to_decode.spec, "consumer", bell_d)
    outbound = Ring.attach(to_prefill.spec, "producer")
    args = [seg.spec.to_json(), LAYOUT.to_json(), to_decode.spec.to_json()]
    args += [to_prefill.spec.to_json(), bell_p.spec.to_json(), str(n)]
    fds = (seg.spec.fd, *ring_fds(to_decode.spec), *ring_fds(to_prefill.spec), bell_p.fd)
    cmd = [sys.executable, "-m", "tests.transport.kv_peer", backend, *args]
    child = subprocess.Popen(cmd, cwd=REPO, pass_fds=fds, stdout=subprocess.PIPE, text=True)
    expected, shared = expected_pool(LAYOUT), pool_view(seg, LAYOUT)
    dst = torch.zeros(LAYOUT.shape, dtype=LAYOUT.torch_dtype, device=device)
    receiver: KVReceiver | None = None
    if backend != "cuda_ipc":
        if device == "cuda":
            register_host_memory(shared)
        receiver = ShmReceiver({0: shared}, dst)
    rng, done = random.Random(7), 0
    while done < n:
        bell_d.wait([inbound], timeout=2.0)
        assert inbound.peer_alive() or inbound.readable()
        for raw in inbound.drain(16):
            msg = records.decode(raw)
            if isinstance(msg, records.KVPoolHandle):  # mapped from this process's GPU
                receiver = CudaIpcReceiver({}, dst)
                receiver.open(0, msg.handle)
                continue
            assert isinstance(msg, records.KVTransfer) and receiver is not None
            dst_blocks = rng.sample(range(LAYOUT.num_blocks), len(msg.src_blocks))
            receiver.fetch(0, msg.src_blocks, dst_blocks)
            got = dst[dst_blocks].cpu()
            assert torch.equal(got.view(torch.uint8), expected[msg.src_blocks].view(torch.uint8))
            outbound.put(records.encode(records.KVRelease(rid=msg.rid, accepted=True)))
            done += 1
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    assert json.loads(out) == {"released": n, "pinned": 0}


@pytest.mark.slow
def test_shm_random_block_sets_arrive_byte_identical_and_are_freed_after_ack() -> None:
    _run_decode_side("shm-cpu", n=300, device="cpu")


@pytest.mark.cuda
@cuda
def test_pinned_shm_staging_to_gpu_arrives_byte_identical() -> None:
    _run_decode_side("shm-cuda", n=300, device="cuda")


@pytest.mark.cuda
@cuda
def test_cuda_ipc_random_block_sets_arrive_byte_identical() -> None:
    _run_decode_side("cuda_ipc", n=300, device="cuda")


@pytest.mark.slow
def test_dead_decode_worker_releases_its_pinned_blocks() -> None:
    bell = Doorbell.create()
    to_decode = Ring.create("kv-dead", 1 << 12, bell)
    producer = Ring.attach(to_decode.spec, "producer")
    cmd = [sys.executable, "-m", "tests.transport.ring_peer", "hold"]
    child = subprocess.Popen(
        [*cmd, to_decode.spec.to_json(), "consumer"],
        cwd=REPO,
        pass_fds=ring_fds(to_decode.spec),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "attached"
    pinned = PinnedBlocks()
    pinned.pin(1, decode_worker=0, blocks=[4, 9])
    pinned.pin(2, decode_worker=0, blocks=[1])
    pinned.pin(3, decode_worker=1, blocks=[2])
    # What a prefill worker does each loop: a dead release-ring peer frees its pins.
    assert producer.peer_alive() and pinned.rids_for(0) == {1, 2}
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not producer.peer_alive()
    assert sorted(pinned.on_peer_dead(0)) == [1, 4, 9]
    assert pinned.num_pinned == 1 and pinned.rids_for(1) == {3}
