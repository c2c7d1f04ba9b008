"""The speculator's gates: batch size, room, and the cost-aware gate (engine/speculative/cost.py):
drafts only where the measured acceptance pays for the measured cost of verifying them."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.build import build_engine
from engine.config import EngineConfig, SpeculativeConfig
from engine.kv.sequence import Sequence
from engine.speculative.cost import Acceptance, StepTimes, allocate
from engine.speculative.proposer import Proposer
from engine.speculative.speculator import Speculator
from wire.params import SamplingParams


class Fixed(Proposer):
    """Offers k drafts of one token (cheap, as the n-gram proposer)."""

    cheap = True

    def __init__(self, token: int = 1) -> None:
        self.token = token

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [[self.token] * k for k in ks]

    def release(self, rid: int) -> None:
        pass


def _setup(model: Path, **kw: int) -> tuple[Speculator, list[Sequence]]:
    engine = build_engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    runner = engine.runner
    speculator = Speculator(engine, SpeculativeConfig(**kw), Fixed())  # type: ignore[arg-type]
    seqs = [
        Sequence(
            rid=i,
            prompt_ids=[5, 6, 7],
            output_ids=[8],
            block_size=runner.block_size,
            sampling=SamplingParams(max_tokens=50),
            num_computed_tokens=3,
        )
        for i in range(3)
    ]
    return speculator, seqs


def test_a_batch_above_the_gate_does_not_speculate(default_model_path: Path) -> None:
    speculator, seqs = _setup(default_model_path, disable_by_batch_size=2)
    speculator.times = None
    assert speculator.drafts(seqs) is None
    assert speculator.stats.skipped["batch_size"] == 3
    assert speculator.drafts(seqs[:2]) == [[1] * 4, [1] * 4]


def test_no_draft_past_max_tokens_or_the_model_length(default_model_path: Path) -> None:
    speculator, seqs = _setup(default_model_path)
    speculator.times = None
    seq = seqs[0]
    seq.sampling = SamplingParams(max_tokens=3)  # 1 output so far: 2 more, 1 of them a draft
    assert speculator.drafts([seq]) == [[1]]
    seq.sampling = SamplingParams(max_tokens=2)
    assert speculator.drafts([seq]) is None and speculator.stats.skipped["length"] == 1


def test_nothing_is_verified_before_a_plain_step_was_timed(default_model_path: Path) -> None:
    speculator, seqs = _setup(default_model_path)
    assert speculator.drafts(seqs[:1]) is None  # no decode step of 1 measured: nothing to compare
    speculator.timed(1, 0, 0.010)
    assert speculator.drafts(seqs[:1]) is not None


def test_k_follows_cost_and_acceptance(default_model_path: Path) -> None:
    """Cheap verification and drafts that hold: all 4; drafts that stop holding: none
    within a few steps; verification as dear as its tokens: none even when they hold."""
    speculator, seqs = _setup(default_model_path)
    seq = seqs[0]
    speculator.timed(1, 0, 0.010)
    for x in (1, 2, 3, 4):
        speculator.timed(1, x, 0.011 + 0.001 * x)  # verifying costs little more than decoding
        speculator.timed(1, 0, 0.010)
    drafted = accepted = 0
    for _ in range(3):  # from the prior's guess up to all 4 as they all hold
        d = speculator.drafts([seq])
        assert d is not None
        speculator.record(seq, len(d[0]), len(d[0]))
        drafted, accepted = drafted + len(d[0]), accepted + len(d[0])
    assert speculator.drafts([seq]) == [[1] * 4]
    steps = 0
    while (d := speculator.drafts([seq])) is not None:  # every draft rejected from now on
        speculator.record(seq, len(d[0]), 0)
        drafted += len(d[0])
        steps += 1
        assert steps < 6  # backs off within a few steps
    assert speculator.stats.skipped["low_acceptance"] > 0
    assert speculator.counts(seq.rid) == (drafted, accepted)

    speculator, seqs = _setup(default_model_path)
    speculator.timed(1, 0, 0.010)
    for x in (1, 2, 3, 4):  # each draft row costs as much as a decode step
        speculator.timed(1, x, 0.010 * (1 + x))
    assert speculator.drafts(seqs[:1]) is None


def test_shadow_drafts_measure_acceptance_without_verifying() -> None:
    """A request that does not speculate still has its drafts scored against the tokens
    it decodes: matching ones raise its acceptance until speculation pays again."""
    prior = [0.5] * 4
    acc = Acceptance([0.0] * 4)
    acc.shadow, acc.shadow_base = [10, 11, 12, 13], 3
    acc.check_shadow([1, 2, 3, 10, 11], prior, final=False)  # 2 matched so far: pending
    assert acc.shadow and acc.rates == [0.0] * 4
    acc.check_shadow([1, 2, 3, 10, 11, 12, 13], prior, final=False)  # all 4 matched
    assert not acc.shadow and all(r is not None and r > 0 for r in acc.rates)
    before = list(acc.rates)
    acc.shadow, acc.shadow_base = [20, 21], 7
    acc.check_shadow([1, 2, 3, 10, 11, 12, 13, 20, 5], prior, final=False)  # 2nd missed
    assert acc.rates[0] is not None and before[0] is not None and acc.rates[0] > before[0]
    assert acc.rates[1] is not None and before[1] is not None and acc.rates[1] < before[1]


def test_allocation_gives_drafts_to_the_requests_most_likely_to_keep_them() -> None:
    times = StepTimes()
    times.observe(2, 0, 0.020)
    times.observe(2, 2, 0.022)
    times.observe(2, 0, 0.020)
    good, bad = Acceptance([0.9] * 4), Acceptance([0.05] * 4)
    prior = [0.5] * 4
    ks = allocate([good.gains(4, prior), bad.gains(4, prior)], 2, times)
    assert ks[0] >= 2 and ks[1] == 0
    assert allocate([bad.gains(4, prior), bad.gains(4, prior)], 2, times) == [0, 0]


def test_a_decode_step_after_a_verification_charges_its_rebuild_to_it() -> None:
    times = StepTimes()
    times.observe(1, 0, 0.010)
    times.observe(1, 4, 0.015)
    times.observe(1, 0, 0.018)  # rebuilt the dense K/V: 8 ms more than a plain step
    assert times.estimate(1, 0) == 0.010
    assert abs((times.estimate(1, 4) or 0) - 0.023) < 1e-9


def test_a_slow_verification_is_tried_again_after_a_while() -> None:
    """One verification timed while another process held the core must not stop a
    worker from speculating for good: after 32 plain steps the prior is tried again."""
    times = StepTimes()
    times.observe(1, 0, 0.010)
    times.observe(1, 4, 0.200)  # 20x a decode step: descheduled
    times.observe(1, 0, 0.010)  # the next step (charged to it once it is known)
    good = Acceptance([0.95] * 4)
    prior = [0.5] * 4
    steps = 0
    while allocate([good.gains(4, prior)], 1, times) == [0]:
        times.observe(1, 0, 0.010)
        steps += 1
        assert steps <= 32
    assert steps > 0


def test_positions_no_request_has_tried_take_the_rate_before_them() -> None:
    """A request whose first two drafts always held is offered all four once verifying
    them pays: the untried positions take the rate measured before them, not a fixed
    guess below what one more row costs (which kept every request at two drafts)."""
    times = StepTimes()
    times.observe(1, 0, 0.016)
    for _ in range(3):
        times.observe(1, 1, 0.020)
        times.observe(1, 0, 0.016)
        times.observe(1, 2, 0.024)
        times.observe(1, 0, 0.016)
    prior: list[float | None] = [None] * 4
    acc = Acceptance([None] * 4)
    for _ in range(5):
        acc.observe(2, 2, prior)
    g = acc.gains(4, prior)
    second = acc.rates[1]
    assert second is not None and second > 0.95 and acc.rates[2:] == [None, None]
    assert g[2] == pytest.approx(g[1] * second) and g[3] == pytest.approx(g[2] * second)
    assert allocate([g], 1, times) == [4]
    # One lucky draft moves a fresh request's rate from the guess, not to 1.
    fresh = Acceptance([None] * 4)
    fresh.observe(1, 1, [None] * 4)
    assert fresh.rates[0] is not None and 0.5 < fresh.rates[0] < 0.8
    # Once a position is measured, its rate counts, the request's own first.
    acc.observe(4, 2, prior)
    gains = acc.gains(4, prior)
    assert gains[2] < 1.0 and gains[3] <= gains[2]
