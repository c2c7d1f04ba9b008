"""Partial KV transfers: a decode worker copies only the blocks it does not already hold.

Prefill and decode schedulers in one process over the shm backend; a recording receiver
shows which blocks each handoff copied. The decode pool must end up with the same KV a
full transfer gives, and outputs must equal those with caching off.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from decode.scheduler import DecodeScheduler
from prefill.scheduler import PrefillScheduler
from tests.pipeline.drive import float_engine
from transport.kv_backends import ShmReceiver
from wire.params import SamplingParams
from wire.records import GenerateRequest

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class RecordingReceiver(ShmReceiver):
    """The shm receiver, noting each fetch's (source blocks, destination blocks)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.fetches: list[tuple[list[int], list[int]]] = []

    def fetch(self, src_worker: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        self.fetches.append((list(src_blocks), list(dst_blocks)))
        super().fetch(src_worker, src_blocks, dst_blocks)


def _pair(model: Path, caching: bool) -> tuple[PrefillScheduler, DecodeScheduler]:
    p_engine, d_engine = float_engine(model, 96, caching), float_engine(model, 96, caching)
    receiver = RecordingReceiver({0: p_engine.kv.tensor}, d_engine.kv.tensor)
    prefill = PrefillScheduler(p_engine, worker_index=0, chunk_budget=512)
    return prefill, DecodeScheduler(d_engine, receiver, max_num_seqs=8)


def _positions(pool: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """KV of positions 0..n-1 of a block table: (layers, K|V, n, kv_heads, head_dim)."""
    per_block = pool[blocks]  # (blocks, layers, 2, block_size, kv_heads, head_dim)
    return per_block.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n]


def _run(
    prefill: PrefillScheduler, decode: DecodeScheduler, rid: int, prompt: list[int]
) -> list[int]:
    """One request through prefill, the handoff and decode to its end; its output ids."""
    prefill.add(
        GenerateRequest(rid=rid, prompt_ids=prompt, sampling=PARAMS, decode_worker=0, detok_shard=0)
    )
    step = prefill.step()
    out = [int(b.token_ids[0]) for b in step.tokens.values()]
    ((_, transfer),) = step.transfers
    assert decode.offer(transfer) == []
    for _, release in decode.admit():
        prefill.release(release.rid)
    seq = decode.running[rid].seq
    # The decode pool now holds every imported position exactly as prefill's pool does.
    n = transfer.num_tokens
    assert torch.equal(
        _positions(prefill.runner.kv.tensor, transfer.src_blocks, n),
        _positions(decode.runner.kv.tensor, seq.block_table, n),
    )
    while rid in decode.running:
        for batch in decode.step().tokens.values():
            out += batch.token_ids.tolist()
    return out


@pytest.mark.parametrize("shared", [4 * BS, 4 * BS - 1, 4 * BS + 1])
def test_a_handoff_copies_only_the_blocks_decode_lacks(
    default_model_path: Path, shared: int
) -> None:
    g = torch.Generator().manual_seed(shared)
    first = torch.randint(0, 150_000, (shared,), generator=g).tolist()
    second = first + torch.randint(0, 150_000, (40,), generator=g).tolist()
    outputs = {}
    for caching in (True, False):
        prefill, decode = _pair(default_model_path, caching)
        receiver = decode.admission.receiver
        assert isinstance(receiver, RecordingReceiver)
        outputs[caching] = [_run(prefill, decode, 0, first), _run(prefill, decode, 1, second)]
        (src0, _), (src1, dst1) = receiver.fetches
        n_blocks = -(-len(second) // BS)
        if not caching:
            assert len(src1) == n_blocks  # everything is copied
            continue
        # Decode holds the full blocks of the first request's prompt (and of its output,
        # decoded there: none of those match the second prompt beyond the shared part).
        held = shared // BS
        assert len(src0) == -(-shared // BS)
        assert len(src1) == n_blocks - held and len(dst1) == n_blocks - held
        assert prefill.runner.kv.allocator.num_pinned == 0  # every transfer released
        stats = decode.runner.kv.allocator.stats
        assert stats.hit_tokens == held * BS and stats.queried_tokens == shared + len(second)
        decode.runner.kv.allocator.check_invariants()
    assert outputs[True] == outputs[False]


def test_a_fully_held_prompt_copies_only_its_partial_last_block(default_model_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 150_000, (3 * BS + 5,), generator=g).tolist()
    prefill, decode = _pair(default_model_path, True)
    receiver = decode.admission.receiver
    assert isinstance(receiver, RecordingReceiver)
    assert _run(prefill, decode, 0, prompt) == _run(prefill, decode, 1, list(prompt))
    (src0, _), (src1, _) = receiver.fetches
    assert len(src0) == 4 and len(src1) == 1  # 3 full blocks held, the 5-token tail copied
