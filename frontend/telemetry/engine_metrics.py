"""The engine's figures in /metrics, read from the engine client at scrape time: each
worker's load (running, waiting, KV usage, prefix cache, what the router placed on it),
speculative decoding under vLLM's names, and the host's KV tiers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from frontend.engine_link.engine_client import EngineClient, WorkerReport
from transport.worker_load import SPECULATION_POSITIONS, SPECULATION_SKIP_REASONS
from wire.roles import Role

logger = logging.getLogger(__name__)


class EngineCollector(Collector):
    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "index", "node"]  # node: the host the worker runs on
        running = GaugeMetricFamily(
            "pdserve_num_requests_running", "Requests running", labels=labels
        )
        waiting = GaugeMetricFamily(
            "pdserve_num_requests_waiting", "Requests queued", labels=labels
        )
        kv = GaugeMetricFamily(
            "pdserve_kv_cache_usage_perc", "KV blocks in use, 0-1", labels=labels
        )
        assigned = CounterMetricFamily(
            "pdserve_router_assigned_requests", "Requests the router placed", labels=labels
        )
        assigned_tokens = CounterMetricFamily(
            "pdserve_router_assigned_tokens",
            "Tokens the router placed: prompts on prefill, prompt + max_tokens on decode",
            labels=labels,
        )
        cached = GaugeMetricFamily(
            "pdserve_prefix_cache_blocks",
            "KV blocks holding a reusable prompt prefix (in use or evictable)",
            labels=labels,
        )
        hit_rate = GaugeMetricFamily(
            "pdserve_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / tokens looked up, 0-1, since the "
            "worker started (decode: handed-off KV tokens it already held)",
            labels=labels,
        )
        hits = GaugeMetricFamily(
            "pdserve_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache since the worker started",
            labels=labels,
        )
        queries = GaugeMetricFamily(
            "pdserve_prefix_cache_queried_tokens",
            "Tokens looked up in the prefix cache since the worker started",
            labels=labels,
        )
        computed = CounterMetricFamily(
            "pdserve_prefill_computed_tokens",
            "Prompt tokens run through the model (below the tokens sent when prompts share "
            "KV: n > 1 choices, cached prefixes)",
            labels=labels,
        )
        try:
            loads = self._client.metrics_snapshot()
        except Exception:  # a scrape must never take the server down
            logger.exception("engine metrics snapshot failed")
            loads = []
        for w in loads:
            key = [w.role, str(w.index), w.node]
            load = w.load
            running.add_metric(key, load.running_requests)
            waiting.add_metric(key, load.waiting_requests)
            kv.add_metric(key, load.kv_usage)
            assigned.add_metric(key, w.assigned_requests)
            assigned_tokens.add_metric(key, w.assigned_tokens)
            cached.add_metric(key, load.cached_blocks)
            hit_rate.add_metric(key, load.prefix_hit_rate)
            hits.add_metric(key, load.prefix_hit_tokens)
            queries.add_metric(key, load.prefix_queried_tokens)
            if w.role != Role.DECODE:  # a StrEnum: equal to its value
                computed.add_metric(key, load.computed_prefill_tokens)
        yield from (
            running,
            waiting,
            kv,
            assigned,
            assigned_tokens,
            cached,
            hit_rate,
            hits,
            queries,
            computed,
        )
        yield from speculation_metrics(loads, labels)
        tiers = self._client.kv_tier_counters
        if tiers is not None:
            yield from _tier_metrics(tiers())


# KV tiers beyond the pools (engine/kv/tiers/): metric, help, and its counter per tier.
_TIER_COUNTERS = (
    (
        "pdserve_kv_tier_hit_blocks",
        "Blocks loaded into a pool from the tier",
        {"host": "host_hit_blocks", "disk": "disk_hit_blocks"},
    ),
    (
        "pdserve_kv_tier_miss_blocks",
        "Blocks looked up in the tier and not loaded from it",
        {"host": "host_miss_blocks", "disk": "disk_miss_blocks"},
    ),
    (
        "pdserve_kv_tier_read_bytes",
        "Bytes loaded from the tier into pools",
        {"host": "host_bytes_out", "disk": "disk_bytes_read"},
    ),
    (
        "pdserve_kv_tier_written_bytes",
        "Bytes stored into the tier",
        {"host": "host_bytes_in", "disk": "disk_bytes_written"},
    ),
    (
        "pdserve_kv_tier_load_seconds",
        "Seconds spent loading blocks from the tier",
        {"host": "host_load_ns", "disk": "disk_load_ns"},
    ),
    (
        "pdserve_kv_tier_store_seconds",
        "Seconds spent storing blocks into the tier",
        {"host": "host_store_ns", "disk": "disk_store_ns"},
    ),
    (
        "pdserve_kv_tier_evictions",
        "Blocks the tier evicted to make room",
        {"host": "host_evictions", "disk": "disk_evictions"},
    ),
    (
        "pdserve_kv_tier_quarantined",
        "Block files that failed a check on load, moved aside",
        {"disk": "disk_quarantined"},
    ),
    (
        "pdserve_kv_tier_dropped",
        "Blocks the disk tier could not write (budget, disk full)",
        {"disk": "disk_dropped"},
    ),
)


def _tier_metrics(c: dict[str, int]) -> Iterator[Metric]:
    for name, doc, per_tier in _TIER_COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, key in per_tier.items():
            fam.add_metric([tier], c[key] / 1e9 if key.endswith("_ns") else c[key])
        yield fam
    usage = GaugeMetricFamily("pdserve_kv_tier_disk_usage_bytes", "Bytes of block files on disk")
    usage.add_metric([], c["disk_usage_bytes"])
    yield usage


def speculation_metrics(loads: list[WorkerReport], labels: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, per decoding worker, and the request-steps
    that did not speculate, by reason (engine/speculative/speculator.py)."""
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    docs = (
        "Request-steps that verified drafts",
        "Draft tokens verified",
        "Draft tokens accepted",
    )
    totals = [
        CounterMetricFamily(f"pdserve_spec_decode_{n}", d, labels=labels)
        for n, d in zip(names, docs, strict=True)
    ]
    per_pos = CounterMetricFamily(
        "pdserve_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by draft position (0: the first draft)",
        labels=[*labels, "position"],
    )
    skipped = CounterMetricFamily(
        "pdserve_spec_decode_skipped",
        "Request-steps that decoded one token without speculation, by reason",
        labels=[*labels, "reason"],
    )
    for w in loads:
        if not w.speculation:
            continue
        key = [w.role, str(w.index), w.node]
        for family, value in zip(totals, w.speculation[:3], strict=True):
            family.add_metric(key, value)
        pos = w.speculation[3 : 3 + SPECULATION_POSITIONS]
        for i, value in enumerate(pos):
            per_pos.add_metric([*key, str(i)], value)
        for reason, value in zip(
            SPECULATION_SKIP_REASONS, w.speculation[3 + SPECULATION_POSITIONS :], strict=True
        ):
            skipped.add_metric([*key, reason], value)
    yield from (*totals, per_pos, skipped)
