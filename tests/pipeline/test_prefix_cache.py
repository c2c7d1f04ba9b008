"""Prefix caching across the prefill -> decode handoff, in one process.

A prefill worker reuses blocks of earlier requests, even while they are pinned for a
transfer; the first token's step reports how many prompt tokens were cached; outputs
equal those with caching off; every block comes back and the invariants hold.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decode.scheduler import DecodeScheduler
from engine.build import build_engine
from engine.config import EngineConfig
from prefill.scheduler import PrefillScheduler, PrefillStep
from tests.pipeline.drive import float_engine
from transport.kv_backends import ShmReceiver
from wire.params import SamplingParams
from wire.records import Finish, GenerateRequest

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _pair(model: Path, caching: bool) -> tuple[PrefillScheduler, DecodeScheduler]:
    p_engine, d_engine = float_engine(model, 128, caching), float_engine(model, 128, caching)
    prefill = PrefillScheduler(p_engine, worker_index=0, chunk_budget=40)
    receiver = ShmReceiver({0: p_engine.kv.tensor}, d_engine.kv.tensor)
    return prefill, DecodeScheduler(d_engine, receiver, max_num_seqs=16)


def _drive(
    prefill: PrefillScheduler, decode: DecodeScheduler, done: list[PrefillStep]
) -> dict[int, list[int]]:
    """Run both schedulers to the end, after the prefill steps in ``done``; rid -> ids."""
    out: dict[int, dict[int, int]] = {}
    steps = list(done)
    for _ in range(1000):
        tokens = [b for s in steps for b in s.tokens.values()]
        for _, transfer in [t for s in steps for t in s.transfers]:
            assert decode.offer(transfer) == []
        for _, release in decode.admit():
            prefill.release(release.rid)
        tokens += decode.step().tokens.values()
        for batch in tokens:
            for rid, pos, tok in zip(
                batch.rids.tolist(), batch.positions.tolist(), batch.token_ids.tolist()
            ):
                out.setdefault(rid, {})[pos] = tok
        if not prefill.waiting and not decode.admission.pending and not decode.running:
            break
        steps = [prefill.step()]
    return {rid: [toks[i] for i in range(len(toks))] for rid, toks in out.items()}


def _req(rid: int, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(
        rid=rid, prompt_ids=prompt, sampling=PARAMS, decode_worker=0, detok_shard=0
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    base = torch.randint(0, 150_000, (70,), generator=g).tolist()
    tails = [torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (5, 1, 20)]
    # 70 + 5: 4 blocks cached; 48 + 1 ends a token past a boundary: 3 blocks; base itself:
    # 4 blocks (its last, partial block is recomputed); 32 + 20: 2 blocks.
    return [base, base + tails[0], base[:48] + tails[1], list(base), base[:32] + tails[2]]


def test_requests_reuse_blocks_pinned_for_an_earlier_transfer(default_model_path: Path) -> None:
    prompts = _prompts()
    results = {}
    for caching in (True, False):
        prefill, decode = _pair(default_model_path, caching)
        assert prefill.add(_req(0, prompts[0])) == Finish.NONE
        chunk = prefill.step()  # 40 tokens, then 30 more and the first token
        first = prefill.step()
        assert first.cached_tokens == {0: 0}
        assert prefill.runner.kv.allocator.num_pinned == 5  # the transfer is not offered yet
        for rid, prompt in enumerate(prompts[1:], start=1):
            prefill.add(_req(rid, prompt))
        # With caching, all four fit one 40-token step: 11 + 1 + 6 + 20 tokens to compute.
        later = prefill.step()
        want = {1: 64, 2: 48, 3: 64, 4: 32} if caching else {}  # off: rid 1 needs 75
        assert later.cached_tokens == want
        results[caching] = _drive(prefill, decode, [chunk, first, later])
        stats = prefill.runner.kv.allocator.stats
        assert stats.hit_tokens == (64 + 48 + 64 + 32 if caching else 0)
        for runner in (prefill.runner, decode.runner):
            a = runner.kv.allocator
            a.check_invariants()
            assert a.num_used == a.num_pinned == 0 and a.num_available == a.num_blocks
            assert (a.num_cached > 0) == caching
    assert results[True] == results[False]
    assert results[True][0] == results[True][3]  # the same prompt, cached or not


def test_a_request_waiting_for_blocks_is_one_query_however_often_it_is_looked_up(
    default_model_path: Path,
) -> None:
    engine = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=6))
    prefill = PrefillScheduler(engine, worker_index=0, chunk_budget=512)
    g = torch.Generator().manual_seed(12)
    a, b = (torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (64, 80))
    prefill.add(_req(0, a))
    prefill.add(_req(1, b))
    for _ in range(3):  # rid 0 holds 4 blocks pinned; rid 1 (5 blocks) waits, looked up
        step = prefill.step()
    assert step.cached_tokens == {} and engine.kv.allocator.num_pinned == 4
    prefill.release(0)
    assert prefill.step().cached_tokens == {1: 0}
    assert engine.kv.allocator.stats.queried_tokens == 64 + 80
