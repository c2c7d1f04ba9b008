"""``launch --workers`` in one process: two co-located schedulers hand KV to each other.

Worker A prefills requests whose ``decode_worker`` is B and exports their KV; B adopts
them through a ``ShmReceiver`` reading A's pool and decodes, releasing A's blocks. Every
request's tokens equal those of a co-located run (float32), whichever way it went, and
both pools end empty."""

from __future__ import annotations

import torch

from colocated.scheduler import ColocatedScheduler
from engine.build import Engine, build_engine
from engine.config import EngineConfig
from transport.kv_backends import ShmReceiver
from wire.params import SamplingParams
from wire.records import Finish, GenerateRequest, KVTransfer, TokenBatch

torch.set_num_threads(1)


def _engine(model: str) -> Engine:
    return build_engine(EngineConfig(model=model, dtype="float32", num_kv_blocks=256))


def _collect(out: dict[int, dict[int, int]], batch: TokenBatch, done: set[int]) -> None:
    for rid, pos, tok, fin in zip(
        batch.rids.tolist(),
        batch.positions.tolist(),
        batch.token_ids.tolist(),
        batch.finish.tolist(),
    ):
        assert pos not in out.setdefault(rid, {})  # each position exactly once
        out[rid][pos] = tok
        if fin != Finish.NONE:
            done.add(rid)


def _serve(
    scheds: list[ColocatedScheduler], reqs: list[GenerateRequest], moved: list[int] | None = None
) -> dict[int, list[int]]:
    """Step every scheduler in turn, delivering handoffs and releases, until all idle;
    the rids handed off go to ``moved``."""
    out: dict[int, dict[int, int]] = {}
    done: set[int] = set()
    for req in reqs:
        assert scheds[req.prefill_at].add(req) == Finish.NONE  # type: ignore[attr-defined]
    for _ in range(10_000):
        for i, sched in enumerate(scheds):
            for j, rel in sched.admit() + sched.releases:
                scheds[j].prefill.release(rel.rid)
            sched.releases = []
            step = sched.step()
            for _, batch in step.tokens:
                _collect(out, batch, done)
            for w, t in step.transfers:
                assert isinstance(t, KVTransfer) and t.prefill_worker == i
                if moved is not None:
                    moved.append(t.rid)
                for j, rel in scheds[w].decode.offer(t):
                    scheds[j].prefill.release(rel.rid)
        if not any(s.has_work for s in scheds) and all(
            not s.prefill.pinned.num_pinned for s in scheds
        ):
            break
    assert set(out) == done == {r.rid for r in reqs}
    return {rid: [toks[p] for p in sorted(toks)] for rid, toks in out.items()}


class _Req(GenerateRequest, frozen=True):
    prefill_at: int = 0


def test_handoffs_between_two_workers_give_the_colocated_tokens() -> None:
    from bundled_models.tiny import tiny_model_dir

    model = str(tiny_model_dir("qwen2"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (3, 20, 47, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def reqs(route: list[tuple[int, int]]) -> list[GenerateRequest]:
        return [
            _Req(rid=i, prompt_ids=p, sampling=params, decode_worker=d, detok_shard=0, prefill_at=a)
            for i, (p, (a, d)) in enumerate(zip(prompts, route, strict=True))
        ]

    alone = ColocatedScheduler(_engine(model), 0, 48, 64)
    want = _serve([alone], reqs([(0, 0)] * 4))
    a, b = _engine(model), _engine(model)
    scheds = [
        ColocatedScheduler(a, 0, 48, 64, receiver=ShmReceiver({1: b.kv.tensor}, a.kv.tensor)),
        ColocatedScheduler(b, 1, 48, 64, receiver=ShmReceiver({0: a.kv.tensor}, b.kv.tensor)),
    ]
    # A -> B, B -> A, A whole, B whole: handoffs both ways beside co-located requests.
    moved: list[int] = []
    got = _serve(scheds, reqs([(0, 1), (1, 0), (0, 0), (1, 1)]), moved)
    assert sorted(moved) == [0, 1]
    assert got == want
    for s in scheds:
        alloc = s.runner.kv.allocator
        alloc.check_invariants()
        assert alloc.num_used == 0 and alloc.num_pinned == 0
