"""A prefill scheduler and a decode scheduler wired in one process, and a loop that runs
them to the end: what the pipeline tests share (no rings, no worker processes)."""

from __future__ import annotations

import time
from pathlib import Path

from decode.scheduler import DecodeScheduler
from engine.build import Engine, build_engine
from engine.config import EngineConfig
from prefill.scheduler import PrefillScheduler
from transport.kv_backends import ShmReceiver
from wire.records import Finish, TokenBatch


def float_engine(model: Path, blocks: int, caching: bool = True) -> Engine:
    """``model`` in float32 with ``blocks`` KV blocks; ``caching`` turns the prefix cache
    on, as ``EngineConfig`` has it by default."""
    config = EngineConfig(
        model=str(model), dtype="float32", num_kv_blocks=blocks, enable_prefix_caching=caching
    )
    return build_engine(config)


def pair(
    model: Path, *, chunk_budget: int = 64, decode_blocks: int = 256
) -> tuple[PrefillScheduler, DecodeScheduler]:
    """Prefill (256 KV blocks) handing off to decode through shared memory."""
    return pair_of(float_engine(model, 256), float_engine(model, decode_blocks), chunk_budget)


def pair_of(
    p_engine: Engine, d_engine: Engine, chunk_budget: int = 64
) -> tuple[PrefillScheduler, DecodeScheduler]:
    """``p_engine``'s prefill handing off to ``d_engine``'s decode through shared memory."""
    receiver = ShmReceiver({0: p_engine.kv.tensor}, d_engine.kv.tensor)
    prefill = PrefillScheduler(p_engine, worker_index=0, chunk_budget=chunk_budget)
    return prefill, DecodeScheduler(d_engine, receiver, max_num_seqs=64)


def run(
    prefill: PrefillScheduler,
    decode: DecodeScheduler,
    *,
    pause_s: float = 0.0,
    timeout_s: float = 120.0,
) -> dict[int, tuple[list[int], int]]:
    """Drive both until every request finished: rid -> (output ids by position, finish).

    ``pause_s`` sleeps between rounds, leaving the core to a grammar compile thread.
    """
    outputs: dict[int, dict[int, int]] = {}
    finish: dict[int, int] = {}

    def collect(batches: dict[int, TokenBatch]) -> None:
        for b in batches.values():
            for rid, pos, tok, fin in zip(
                b.rids.tolist(), b.positions.tolist(), b.token_ids.tolist(), b.finish.tolist()
            ):
                outputs.setdefault(rid, {})[pos] = tok
                if fin != Finish.NONE:
                    finish[rid] = fin

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pause_s:
            time.sleep(pause_s)
        p = prefill.step()
        collect(p.tokens)
        for _, transfer in p.transfers:
            assert decode.offer(transfer) == []
        for _, release in decode.admit():
            prefill.release(release.rid)
        collect(decode.step().tokens)
        if not (
            prefill.waiting
            or decode.admission.pending
            or decode.running
            or decode.admission.compiling
        ):
            break
    assert set(outputs) == set(finish)
    return {r: ([tok for _, tok in sorted(t.items())], finish[r]) for r, t in outputs.items()}
