"""The choices of an ``n > 1`` request share their prompt's KV on the prefill worker.

The leader's prompt is computed once; its forks get references on its blocks (no copy,
no compute) and are sampled from its logits row, each with its own seed: each choice is
exactly what it would be as a request of its own.
"""

from __future__ import annotations

from pathlib import Path

from colocated.scheduler import ColocatedScheduler
from engine.build import build_engine
from engine.config import EngineConfig
from tests.pipeline.drive import pair, run
from wire.params import SamplingParams, choice_seed
from wire.records import Finish, GenerateRequest

PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 and a partial one


def _choices(n: int, seed: int, first_rid: int = 0) -> list[GenerateRequest]:
    out = []
    for i in range(n):
        params = SamplingParams(
            max_tokens=10, temperature=1.0, seed=choice_seed(seed, i), ignore_eos=True
        )
        out.append(
            GenerateRequest(
                rid=first_rid + i,
                prompt_ids=PROMPT,
                sampling=params,
                decode_worker=0,
                detok_shard=0,
                forks=n - 1 if i == 0 else 0,
                fork_of=-1 if i == 0 else first_rid,
            )
        )
    return out


def _alone(model: Path, req: GenerateRequest) -> list[int]:
    prefill, decode = pair(model)
    prefill.add(
        GenerateRequest(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            sampling=req.sampling,
            decode_worker=0,
            detok_shard=0,
        )
    )
    return run(prefill, decode)[req.rid][0]


def test_the_prompt_is_computed_and_allocated_once_for_n_choices(default_model_path: Path) -> None:
    prefill, decode = pair(default_model_path)
    alloc = prefill.runner.kv.allocator
    choices = _choices(3, seed=42)
    for req in choices:
        assert prefill.add(req) == Finish.NONE
    assert prefill.num_waiting == 3 and len(prefill.waiting) == 1
    step = prefill.step()
    assert step.ran_tokens == len(PROMPT) == prefill.computed_tokens
    assert len(step.transfers) == 3
    # Three blocks hold the prompt, each referenced by the three pinned transfers.
    assert alloc.num_pinned == 3 and alloc.num_used == 0
    assert {tuple(t.src_blocks) for _, t in step.transfers} == {tuple(range(3))}
    for _, t in step.transfers:
        decode.offer(t)
    for _, release in decode.admit():
        prefill.release(release.rid)
    assert alloc.num_pinned == 0
    alloc.check_invariants()
    outs = run(prefill, decode)
    got = {rid: ids for rid, (ids, _) in outs.items()}
    firsts = {rid: step.tokens[0].token_ids[i] for i, rid in enumerate(step.tokens[0].rids)}
    full = {rid: [int(firsts[rid]), *got[rid]] for rid in got}
    assert len({tuple(v) for v in full.values()}) == 3  # three different choices
    for req in choices:  # each exactly as it would be alone
        assert full[req.rid] == _alone(default_model_path, req)


def test_a_fork_whose_leader_is_gone_runs_alone(default_model_path: Path) -> None:
    prefill, decode = pair(default_model_path)
    leader, fork = _choices(2, seed=1)
    prefill.add(leader)
    prefill.abort(leader.rid)
    prefill.add(fork)
    out = run(prefill, decode)
    assert set(out) == {fork.rid} and out[fork.rid][1] == Finish.LENGTH
    prefill.runner.kv.allocator.check_invariants()


def test_an_aborted_leader_hands_its_forks_on(default_model_path: Path) -> None:
    prefill, decode = pair(default_model_path)
    choices = _choices(3, seed=2)
    for req in choices:
        prefill.add(req)
    prefill.abort(choices[0].rid)
    out = run(prefill, decode)
    assert set(out) == {1, 2}
    assert prefill.runner.kv.allocator.num_used == 0


def test_colocated_forks_copy_the_prompt_tail_they_write_into(default_model_path: Path) -> None:
    cfg = EngineConfig(model=str(default_model_path), dtype="float32", num_kv_blocks=64)
    sched = ColocatedScheduler(build_engine(cfg), 0, chunk_budget=64, max_num_seqs=8)
    choices = _choices(3, seed=9)
    for req in choices:
        sched.add(req)
    outputs: dict[int, list[int]] = {}
    while sched.has_work:
        for _, batch in sched.step().tokens:
            for rid, tok in zip(batch.rids.tolist(), batch.token_ids.tolist()):
                outputs.setdefault(rid, []).append(tok)
    assert sched.prefill.computed_tokens == len(PROMPT)
    sched.runner.kv.allocator.check_invariants()
    for req in choices:
        assert outputs[req.rid] == _alone(default_model_path, req)
