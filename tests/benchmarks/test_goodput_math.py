"""The goodput benchmark's arithmetic: arrival schedules, attainment, goodput, configs."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.goodput.configs import default_configs, parse_config
from benchmarks.goodput.slo import Bound, Outcome, Slo, attainment, goodput
from benchmarks.goodput.traces import (
    CHAT,
    DOC,
    PHASED,
    phase_at,
    poisson_times,
    request_count,
    schedule,
)


def test_poisson_times_are_seeded_increasing_and_average_the_rate() -> None:
    a = poisson_times(4.0, 4000, random.Random(7))
    assert a == poisson_times(4.0, 4000, random.Random(7))
    assert a != poisson_times(4.0, 4000, random.Random(8))
    assert all(x < y for x, y in itertools.pairwise(a)) and a[0] > 0
    # 4000 exponential gaps of mean 0.25 s: the mean is within a few standard errors.
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.06)


def test_poisson_gaps_are_exponential_not_regular() -> None:
    times = poisson_times(1.0, 2000, random.Random(1))
    gaps = [y - x for x, y in zip([0.0, *times], times)]
    # An exponential's coefficient of variation is 1; a fixed interval's is 0.
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std / mean == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("rate,count", [(0.0, 3), (-1.0, 3), (1.0, 0)])
def test_poisson_times_refuse_bad_arguments(rate: float, count: int) -> None:
    with pytest.raises(ValueError):
        poisson_times(rate, count, random.Random(0))


def test_request_count_is_rate_times_duration_within_bounds() -> None:
    assert request_count(1.5, 20, 4, 100) == 30
    assert request_count(0.1, 20, 4, 100) == 4
    assert request_count(10, 20, 4, 100) == 100
    with pytest.raises(ValueError):
        request_count(1, 10, 5, 4)


def test_phases_cycle_chat_doc_mix() -> None:
    names = [phase_at(PHASED, t, 10.0).name for t in (0, 9.9, 10, 25, 30, 41)]
    assert names == ["chat", "chat", "doc", "mix", "chat", "doc"]
    with pytest.raises(ValueError):
        phase_at(PHASED, 1.0, 0.0)


def test_phased_schedule_draws_each_phase_from_its_shapes() -> None:
    arrivals = schedule(PHASED, 8.0, 600, 5.0, seed=3)
    assert arrivals == schedule(PHASED, 8.0, 600, 5.0, seed=3)
    by_phase: dict[str, set[str]] = {}
    for a in arrivals:
        assert a.phase == phase_at(PHASED, a.at, 5.0).name
        by_phase.setdefault(a.phase, set()).add(a.shape)
        shape = CHAT if a.shape == "chat" else DOC
        assert shape.prompt[0] <= a.prompt_len <= shape.prompt[1]
        assert shape.output[0] <= a.output_len <= shape.output[1]
    assert by_phase == {"chat": {"chat"}, "doc": {"doc"}, "mix": {"chat", "doc"}}


def _outcomes(ttfts_ms: list[float], tpot_ms: float = 10.0) -> list[Outcome]:
    return [Outcome(True, t / 1000, tpot_ms / 1000) for t in ttfts_ms]


def test_attainment_needs_both_targets_and_a_finished_request() -> None:
    slo = Slo(ttft_ms=100, tpot_ms=20)
    outcomes = [
        Outcome(True, 0.05, 0.01),  # meets both
        Outcome(True, 0.15, 0.01),  # TTFT missed
        Outcome(True, 0.05, 0.03),  # TPOT missed
        Outcome(False, 0.01, 0.01),  # failed: a miss whatever its timings
        Outcome(True, 0.10, None),  # one output token: no TPOT to miss; TTFT at the bound
    ]
    assert [o.meets(slo) for o in outcomes] == [True, False, False, False, True]
    assert attainment(outcomes, slo) == pytest.approx(2 / 5)
    assert attainment([], slo) == 0.0
    with pytest.raises(ValueError):
        Slo(0, 10)


def test_goodput_interpolates_between_the_last_meeting_and_first_missing_rate() -> None:
    g = goodput([(1.0, 1.0), (2.0, 0.95), (3.0, 0.75), (4.0, 0.2)])
    # 0.95 -> 0.75 between 2 and 3 req/s: 0.9 is a quarter of the way.
    assert g.bound is Bound.EXACT and g.rate == pytest.approx(2.25)
    assert g.text() == "2.25"


def test_goodput_takes_the_first_miss_and_ignores_later_recoveries() -> None:
    g = goodput([(3.0, 0.95), (1.0, 1.0), (2.0, 0.8)])  # order of points does not matter
    assert g.rate == pytest.approx(1.0 + 0.1 / 0.2)
    assert goodput([(1.0, 0.9), (2.0, 0.5), (3.0, 0.99)]).rate == pytest.approx(1.0)


def test_goodput_edges_never_and_always_meeting() -> None:
    never = goodput([(0.5, 0.3), (1.0, 0.0)])
    assert (never.bound, never.rate, never.value(), never.text()) == (Bound.BELOW, 0.5, 0, "< 0.5")
    always = goodput([(0.5, 1.0), (1.0, 0.9)])
    assert (always.bound, always.value(), always.text()) == (Bound.AT_LEAST, 1.0, ">= 1")
    with pytest.raises(ValueError):
        goodput([])
    with pytest.raises(ValueError):
        goodput([(1.0, 1.0), (1.0, 0.5)])


def test_configs_parse_and_default_to_what_fits_the_host() -> None:
    assert parse_config("1p2d").launch_args == ("--prefill", "1", "--decode", "2")
    assert parse_config("colocated2").launch_args == ("--colocated", "2")
    assert parse_config("workers4").adaptive
    for bad in ("2x2", "0p1d", "colocated0", "workers"):
        with pytest.raises(ValueError):
            parse_config(bad)
    assert default_configs(2) == ["1p1d", "1p2d", "2p4d", "colocated1", "colocated2", "workers6"]
    assert default_configs(4)[:4] == ["1p1d", "1p2d", "2p4d", "4p8d"]
