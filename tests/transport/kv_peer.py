"""A prefill worker's KV export side, run as a real child process by the KV tests.

    python -m tests.transport.kv_peer BACKEND SEG_JSON LAYOUT_JSON OUT_RING IN_RING BELL N

BACKEND is ``shm-cpu`` (pool lives in the segment), ``shm-cuda`` (GPU pool, segment is
the pinned staging mirror) or ``cuda_ipc`` (GPU pool, handle sent over OUT_RING first).
It fills its pool from a seed, sends N KVTransfers of random non-contiguous block sets,
frees blocks only on KVRelease, and prints how many blocks it freed.
"""

from __future__ import annotations

import json
import random
import sys

import torch

from transport.doorbell import Doorbell, DoorbellSpec
from transport.kv import KVExporter, PinnedBlocks, pool_view
from transport.kv_backends import CudaIpcExporter, ShmExporter, register_host_memory
from transport.ring import Ring, RingSpec
from transport.segment import Segment, SegmentSpec
from wire import records
from wire.kv_layout import KVLayout
from wire.params import SamplingParams

SEED = 20260


def expected_pool(layout: KVLayout) -> torch.Tensor:
    """The bytes prefill holds; the decode side regenerates them to check its copies."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(layout.shape, generator=g).to(layout.torch_dtype)


def make_exporter(backend: str, seg: Segment, layout: KVLayout) -> KVExporter:
    shared = pool_view(seg, layout)
    if backend == "shm-cpu":
        shared.copy_(expected_pool(layout))
        return ShmExporter(shared)
    pool = expected_pool(layout).cuda()
    if backend == "shm-cuda":
        register_host_memory(shared)
        return ShmExporter(pool, staging=shared)
    return CudaIpcExporter(pool)


def transfer(rid: int, blocks: list[int], block_size: int) -> records.KVTransfer:
    return records.KVTransfer(
        rid=rid,
        prefill_worker=0,
        src_blocks=blocks,
        num_tokens=len(blocks) * block_size,
        prompt_ids=[1] * (len(blocks) * block_size),
        output_ids=[2],
        sampling=SamplingParams(),
        detok_shard=0,
    )


def run(argv: list[str]) -> int:
    backend = argv[0]
    seg = Segment.attach(SegmentSpec.from_json(argv[1]))
    layout = KVLayout.from_json(argv[2])
    bell = Doorbell.attach(DoorbellSpec.from_json(argv[5]))
    out = Ring.attach(RingSpec.from_json(argv[3]), "producer")
    inbound = Ring.attach(RingSpec.from_json(argv[4]), "consumer", bell)
    exporter, pinned = make_exporter(backend, seg, layout), PinnedBlocks()
    if backend == "cuda_ipc":
        out.put(records.encode(records.KVPoolHandle(prefill_worker=0, handle=exporter.handle())))
    free, rng, sent, freed = set(range(layout.num_blocks)), random.Random(SEED), 0, 0
    while freed < sent or sent < int(argv[6]):
        want = rng.randint(1, 8)
        if sent < int(argv[6]) and len(free) >= want:
            blocks = rng.sample(sorted(free), want)  # random, mostly non-contiguous
            free.difference_update(blocks)
            exporter.export(blocks)
            pinned.pin(sent, 0, blocks)
            out.put(records.encode(transfer(sent, blocks, layout.block_size)), timeout=30)
            sent += 1
            continue
        bell.wait([inbound], timeout=1.0)
        for raw in inbound.drain(64):
            msg = records.decode(raw)
            assert isinstance(msg, records.KVRelease)
            released = pinned.on_release(msg.rid)
            free.update(released)
            freed += 1
        if not inbound.peer_alive():
            return 1
    print(json.dumps({"released": freed, "pinned": pinned.num_pinned}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
