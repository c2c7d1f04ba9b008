"""The prefix-cache benchmark's own arithmetic: the ideal hit rate and the report."""

from __future__ import annotations

from benchmarks.serving.prefix_cache import CONFIGS, DATASETS, hit_rate, ideal_hit_rate, report


def test_ideal_hit_rate_counts_block_aligned_prefixes_seen_before() -> None:
    a = list(range(100))
    # b shares 40 tokens with a (2 full blocks); c repeats a (6 blocks, its last token
    # is recomputed: 99 // 16 = 6 blocks); d shares nothing.
    b, c, d = a[:40] + [7] * 30, list(a), [5] * 50
    assert ideal_hit_rate([a, b, c, d]) == (0 + 32 + 96 + 0) / (100 + 70 + 100 + 50)
    assert ideal_hit_rate([a[:32], a[:32]]) == 16 / 64  # a boundary: the last block recomputed


def test_hit_rate_is_the_ratio_of_metric_deltas() -> None:
    before = {
        ("pdserve_prefix_cache_hit_tokens", "prefill", 0): 10.0,
        ("pdserve_prefix_cache_queried_tokens", "prefill", 0): 100.0,
    }
    after = {
        ("pdserve_prefix_cache_hit_tokens", "prefill", 0): 70.0,
        ("pdserve_prefix_cache_hit_tokens", "prefill", 1): 30.0,
        ("pdserve_prefix_cache_queried_tokens", "prefill", 0): 200.0,
        ("pdserve_prefix_cache_queried_tokens", "prefill", 1): 100.0,
    }
    assert hit_rate(before, after, "prefill") == 90 / 200
    assert hit_rate(before, after, "decode") == 0.0


def test_report_has_a_row_per_run_and_the_ratios() -> None:
    rows = [
        {
            "dataset": d,
            "config": c,
            "p50_ttft_ms": 10.0 if c == "on" else 40.0,
            "p90_ttft_ms": 1.0,
            "p99_ttft_ms": 2.0,
            "p50_tpot_ms": 3.0,
            "prefill_hit_rate": 0.6,
            "decode_hit_rate": 0.6,
            "prefill_tokens": {0: 5.0, 1: 6.0},
        }
        for d in DATASETS
        for c in CONFIGS
    ]
    text = report(rows, dict.fromkeys(DATASETS, 0.8), "python -m benchmarks.serving.prefix_cache")
    assert text.count("| 5 / 6 |") == len(rows)
    assert text.count("off / on = **4.00x**") == len(DATASETS) and "(75%)" in text
