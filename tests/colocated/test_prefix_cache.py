"""Co-located prefix caching: a later turn reuses the earlier turn's prompt and answer,
and requests preempted for lack of blocks reuse what survived; outputs never change."""

from __future__ import annotations

from pathlib import Path

import torch

from colocated.scheduler import ColocatedScheduler
from tests.colocated.test_scheduler import _assert_all_free, _req, _run
from tests.pipeline.drive import float_engine
from wire.params import SamplingParams

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _sched(model: Path, caching: bool, blocks: int = 128) -> ColocatedScheduler:
    return ColocatedScheduler(
        float_engine(model, blocks, caching), worker_index=0, chunk_budget=48, max_num_seqs=16
    )


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(
    default_model_path: Path,
) -> None:
    g = torch.Generator().manual_seed(21)
    first = torch.randint(0, 150_000, (45,), generator=g).tolist()
    new = torch.randint(0, 150_000, (6,), generator=g).tolist()
    outputs = {}
    for caching in (True, False):
        sched = _sched(default_model_path, caching)
        sched.add(_req(0, first, PARAMS))
        answer = _run(sched)[0]
        sched.add(_req(1, first + answer + new, PARAMS))
        outputs[caching] = (answer, _run(sched)[1])
        # 45 + 20 - 1 tokens had KV when turn one ended: four full blocks.
        assert sched.runner.kv.allocator.stats.hit_tokens == (64 if caching else 0)
        _assert_all_free(sched)
    assert outputs[True] == outputs[False]


def test_preempted_requests_reuse_their_surviving_blocks(default_model_path: Path) -> None:
    prompts = [[300 + i] * 40 for i in range(6)]
    outputs = {}
    for caching in (True, False):
        # 23 blocks for 6 x 60 tokens: one request is preempted, and when it resumes
        # every block but its newest token's survives (no prefill: decode runs it).
        sched = _sched(default_model_path, caching, blocks=23)
        for rid, prompt in enumerate(prompts):
            sched.add(_req(rid, prompt, PARAMS))
        outputs[caching] = _run(sched)
        _assert_all_free(sched)
        assert (sched.runner.kv.allocator.stats.hit_tokens > 0) == caching
    assert outputs[True] == outputs[False]
