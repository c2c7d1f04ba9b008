"""Speculative decoding counters: decode worker -> load table -> /metrics, vLLM's names."""

from __future__ import annotations

from collections import Counter

from engine.speculative.speculator import SpeculationStats
from frontend.engine_link.worker_status import worker_metrics
from frontend.telemetry.engine_metrics import speculation_metrics
from runtime.worker import speculation_counters
from transport.load_table import LoadTable
from wire.roles import Role


def test_a_decode_workers_speculation_reaches_metrics() -> None:
    table = LoadTable(bytearray(LoadTable.layout_nbytes(2)), 2)
    stats = SpeculationStats(
        num_drafts=7,
        num_draft_tokens=20,
        num_accepted_tokens=12,
        accepted_per_pos=[6, 4, 2, 0],
        skipped=Counter(batch_size=3, no_draft=9),
    )
    decode, prefill = table.writer(0), table.writer(1)
    decode.claim(Role.DECODE, 0, block_size=16, node="n")
    decode.publish(**speculation_counters(stats))
    prefill.claim(Role.PREFILL, 0, block_size=16, node="n")
    prefill.publish(running_requests=1)
    loads = worker_metrics(table, {}, node="n")
    assert [w.speculation != () for w in loads] == [True, False]  # prefill never speculates
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in speculation_metrics(loads, ["role", "index", "node"])
        for s in family.samples
    }
    key = (("index", "0"), ("node", "n"), ("role", "decode"))
    assert samples[("pdserve_spec_decode_num_drafts_total", key)] == 7
    assert samples[("pdserve_spec_decode_num_draft_tokens_total", key)] == 20
    assert samples[("pdserve_spec_decode_num_accepted_tokens_total", key)] == 12
    per_pos = "pdserve_spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, tuple(sorted([*key, ("position", str(i))])))] for i in range(4)] == [
        6,
        4,
        2,
        0,
    ]
    skipped = "pdserve_spec_decode_skipped_total"
    assert samples[(skipped, tuple(sorted([*key, ("reason", "no_draft")])))] == 9
    assert samples[(skipped, tuple(sorted([*key, ("reason", "low_acceptance")])))] == 0
