"""The planner's decisions from synthetic samples and load rows, and the role table."""

from __future__ import annotations

import time

import pytest

from frontend.engine_link.roles import RoleControl
from router.planner import (
    Planner,
    PlannerConfig,
    Sample,
    decide,
    level_of,
    level_roles,
    queue_ttft,
)
from transport.load_table import LoadTable, WorkerState
from transport.role_table import SAMPLES, RoleTable, RoleTableError
from wire.roles import Role

C, P, D = Role.COLOCATED, Role.PREFILL, Role.DECODE
CONFIG = PlannerConfig(slo_ttft_s=2.0, slo_tpot_s=0.1, dwell_s=10.0, min_samples=4)


def _table(n: int = 4) -> RoleTable:
    return RoleTable.format(bytearray(RoleTable.layout_nbytes(n, 1)), n, 1)


def _samples(at: float, ttft: float, tpot: float, n: int = 8) -> list[Sample]:
    return [Sample(at, ttft, tpot) for _ in range(n)]


def test_the_ladder_moves_one_worker_at_a_time_past_level_0() -> None:
    assert level_roles(0, 4) == [C, C, C, C]  # the start
    assert level_roles(0, 2) == [C, C] and level_roles(1, 2) == [P, D]
    assert level_roles(1, 4) == [P, P, P, D]
    assert level_roles(3, 4) == [P, D, D, D]
    assert [level_of(level_roles(i, 4)) for i in range(4)] == [0, 1, 2, 3]
    assert level_of([D, P, P, P]) is None  # set by hand: off the ladder


@pytest.mark.parametrize(
    ("level", "ttft", "tpot", "want"),
    [
        (0, 1.0, 0.2, 1),  # TPOT over: isolate decode
        (1, 1.0, 0.2, 2),
        (3, 1.0, 0.2, 3),  # no level further up
        (2, 3.0, 0.05, 1),  # TTFT over: more prefill
        (1, 3.0, 0.05, 0),
        (0, 3.0, 0.05, 0),  # no level further down
        (1, 1.0, 0.05, 1),  # both met: stay
        (1, 4.0, 0.15, 0),  # both over: TTFT 2x beats TPOT 1.5x
        (1, 2.4, 0.3, 2),  # both over: TPOT 3x beats TTFT 1.2x
        (2, 3.0, None, 1),  # one-token outputs: TTFT alone judges
    ],
)
def test_decide_follows_the_target_missed_most(
    level: int, ttft: float, tpot: float | None, want: int
) -> None:
    new, why = decide(level, 4, ttft, tpot, CONFIG)
    assert new == want
    assert bool(why) == (new != level)


def test_a_missed_tpot_splits_the_roles_after_the_dwell_and_logs_each_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = _table(2)
    planner = Planner(table, CONFIG)
    t0 = planner.changed_at
    for s in _samples(t0 + 1, 0.5, 0.3):
        planner.observe(s)
    assert not planner.step([], now=t0 + 5)  # within the dwell time: no change
    with caplog.at_level("INFO"):
        assert planner.step([], now=t0 + 11)
    assert table.roles() == [P, D]
    assert sum("role colocated ->" in r.message for r in caplog.records) == 2
    # Samples from before the change do not judge the new roles: no flapping back.
    assert not planner.step([], now=t0 + 30)
    assert table.roles() == [P, D]


def test_a_missed_ttft_after_the_split_goes_back_to_colocated() -> None:
    table = _table(2)
    planner = Planner(table, CONFIG)
    planner.apply([P, D], "test")
    t0 = planner.changed_at
    for s in _samples(t0 + 1, 5.0, 0.02):
        planner.observe(s)
    assert not planner.step([], now=t0 + 9)
    assert planner.step([], now=t0 + 12)
    assert table.roles() == [C, C]
    report = {w.index: w for w in table.report()}
    assert report[0].changes == 2 and report[1].changes == 2


def test_at_a_low_rate_the_latest_samples_judge_however_old() -> None:
    """Document-like requests at 0.1 req/s: fewer than ``min_samples`` arrive in a
    window, so the latest that arrived under the level judge it."""
    table = _table(2)
    planner = Planner(table, CONFIG)
    t0 = planner.changed_at
    for i in range(4):
        planner.observe(Sample(t0 + 10 * i, 0.5, 0.3))
    assert planner.step([], now=t0 + 60)  # one of them within the 30 s window
    assert table.roles() == [P, D]


def test_too_few_samples_or_roles_set_by_hand_change_nothing() -> None:
    table = _table(2)
    planner = Planner(table, CONFIG)
    t0 = planner.changed_at
    for s in _samples(t0 + 1, 0.5, 0.3, n=3):
        planner.observe(s)
    assert not planner.step([], now=t0 + 20)
    planner.observe(Sample(t0 + 2, 0.5, 0.3))
    table.mark_by_hand()
    assert not planner.step([], now=t0 + 20)
    assert table.roles() == [C, C]


def _rows(queued: list[int], computed: list[int]) -> LoadTable:
    table = LoadTable(bytearray(LoadTable.layout_nbytes(len(queued))), len(queued))
    for i, (q, c) in enumerate(zip(queued, computed, strict=True)):
        w = table.writer(i)
        w.claim(Role.COLOCATED, i)
        w.set_state(WorkerState.READY)
        w.publish(queued_prefill_tokens=q, computed_prefill_tokens=c)
    return table


def test_queued_prompt_tokens_count_as_ttft_before_any_request_finishes() -> None:
    rows = _rows([4000, 6000, 100], [0, 0, 0]).snapshot()
    # Workers 0 and 1 take new requests; the decoder's queue is not a new request's wait.
    assert queue_ttft(rows, [P, P, D], rate=1000.0) == pytest.approx(5.0)
    assert queue_ttft(rows, [P, P, D], rate=0.0) == 0.0
    table = _table(3)
    planner = Planner(table, CONFIG)
    planner.apply(level_roles(1, 3), "test")
    t0 = planner.changed_at
    for s in _samples(t0 + 1, 0.5, 0.02):  # what finished was fast ...
        planner.observe(s)
    load = _rows([4000, 6000, 0], [0, 0, 0])
    planner.step(load.snapshot(), now=t0 + 11)  # first figure: no rate yet
    for i, done in enumerate([2000, 2000]):  # ... 2000 tokens/s each, 5000 queued each
        load.writer(i).publish(computed_prefill_tokens=done)
    assert planner.step(load.snapshot(), now=t0 + 12)
    assert table.roles() == [C, C, C]


def test_the_role_table_keeps_time_in_each_role_and_placements_by_kind() -> None:
    table = _table(2)
    assert table.roles() == [C, C]  # the start roles
    assert table.set(1, D) and not table.set(1, D)
    assert [w.changes for w in table.report()] == [0, 1]
    assert table.report()[1].role is D
    assert set(table.report()[0].seconds) == {P, D, C}
    table.count(0, "local")
    table.count(0, "local")
    table.count(0, "handoff")
    assert table.placements() == {"handoff": 1, "local": 2, "colocated": 0}
    with pytest.raises(ValueError):
        table.set(0, Role.DETOK)
    with pytest.raises(RoleTableError):
        RoleTable(bytearray(64))
    again = RoleTable(table._words.data)  # another process's view of the same bytes
    assert again.roles() == [C, D]


def test_each_frontend_rings_its_samples_and_a_lapped_reader_loses_only_the_oldest() -> None:
    table = RoleTable.format(bytearray(RoleTable.layout_nbytes(2, 2)), 2, 2)
    table.add_sample(1, 10.0, 0.5, 0.02)
    table.add_sample(1, 11.0, 0.6, None)  # one output token: no TPOT
    got, seen = table.samples_since(1, 0)
    assert got == [(10.0, 0.5, 0.02), (11.0, 0.6, None)] and seen == 2
    assert table.samples_since(0, 0) == ([], 0)  # frontend 0's ring is apart
    assert table.samples_since(1, seen) == ([], 2)
    for i in range(SAMPLES + 5):  # the reader lags past the ring
        table.add_sample(1, 100.0 + i, 1.0, 0.01)
    got, seen = table.samples_since(1, seen)
    # The oldest slot may be being written over as it is read: it is left out too.
    assert seen == SAMPLES + 7 and len(got) == SAMPLES - 1
    assert got[0][0] == 100.0 + 6 and got[-1][0] == 100.0 + SAMPLES + 4
    again = RoleTable(table._words.data)  # another process's view of the same bytes
    assert again.sample_count(1) == SAMPLES + 7


def test_the_planner_in_frontend_0_judges_every_frontends_requests() -> None:
    """Requests that finish in frontend 1 alone move frontend 0's planner."""
    table = RoleTable.format(bytearray(RoleTable.layout_nbytes(4, 2)), 4, 2)
    slo_ms = (2000.0, 100.0)
    owner = RoleControl(table, 0, slo_ms, allow_override=False)
    other = RoleControl(table, 1, slo_ms, allow_override=False)
    assert owner.planner is not None and other.planner is None
    owner.planner.changed_at -= 20.0  # the start roles have held past the dwell time
    now = time.monotonic()
    for _ in range(8):  # TTFT 1 s, TPOT 0.5 s: five times its target
        other.observe(now - 6.0, now - 5.0, 11)
    assert owner.take_samples() == 8
    assert owner.take_samples() == 0
    assert owner.planner.step([])
    assert table.roles() == [P, P, P, D]  # one level up: decode isolated
