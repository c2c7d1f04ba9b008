"""Prometheus metrics of one frontend: latencies it observes, engine load, GPU state.

Latencies are measured here, at the HTTP boundary, so they include queueing, transfer
and detokenization. Engine load (running/waiting/KV usage per worker) is read from the
engine client at scrape time; GPU utilisation and memory come from NVML when a driver is
present. Each app owns its registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from frontend.engine_link.engine_client import EngineClient

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "index"]
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
            key = [w.role, str(w.index)]
            running.add_metric(key, w.running)
            waiting.add_metric(key, w.waiting)
            kv.add_metric(key, w.kv_usage)
            assigned.add_metric(key, w.assigned_requests)
            assigned_tokens.add_metric(key, w.assigned_tokens)
            cached.add_metric(key, w.cached_blocks)
            hit_rate.add_metric(key, w.prefix_hit_rate)
            hits.add_metric(key, w.prefix_hit_tokens)
            queries.add_metric(key, w.prefix_queried_tokens)
            if w.role != "decode":
                computed.add_metric(key, w.computed_prefill_tokens)
        yield from (running, waiting, kv, assigned, assigned_tokens, cached, hit_rate, hits,
                    queries, computed)  # fmt: skip


class _NvmlCollector(Collector):
    """GPU utilisation and memory per device; registered only if NVML initialises."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    @classmethod
    def try_create(cls) -> _NvmlCollector | None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # no driver, no GPU, or no nvidia-ml-py: no GPU metrics
            logger.info("NVML unavailable, GPU metrics disabled: %s", e)
            return None
        return cls(pynvml)

    def collect(self) -> Iterator[Metric]:
        nv = self._nvml
        util = GaugeMetricFamily("pdserve_gpu_utilization_perc", "GPU busy, 0-100", labels=["gpu"])
        used = GaugeMetricFamily("pdserve_gpu_memory_used_bytes", "GPU memory", labels=["gpu"])
        total = GaugeMetricFamily("pdserve_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                util.add_metric([str(i)], nv.nvmlDeviceGetUtilizationRates(handle).gpu)
                used.add_metric([str(i)], mem.used)
                total.add_metric([str(i)], mem.total)
        except Exception:
            logger.exception("NVML query failed")
        yield from (util, used, total)


class _AcceptorCollector(Collector):
    def __init__(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        accepted, answered, _ = self._stats()
        yield CounterMetricFamily(
            "pdserve_http_connections_accepted", "TCP connections accepted", value=accepted
        )
        yield CounterMetricFamily(
            "pdserve_health_probes_answered",
            "GET /health probes answered by the accept thread, off the event loop",
            value=answered,
        )


class _ConnectionsCollector(Collector):
    def __init__(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        held, refused, timed_out = self._stats()
        yield GaugeMetricFamily("pdserve_http_connections_open", "Client connections held",
                                value=held)  # fmt: skip
        yield CounterMetricFamily(
            "pdserve_http_connections_refused",
            "Connections refused with 503: over --max-connections(-per-peer)",
            value=refused,
        )
        yield CounterMetricFamily(
            "pdserve_http_request_timeouts",
            "Connections closed because a request head or body came too slowly",
            value=timed_out,
        )


class FrontendMetrics:
    """The frontend's registry and the instruments handlers update."""

    def __init__(self, client: EngineClient, *, nvml: bool = True) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=reg)  # fmt: skip
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between output deltas",
                             buckets=_LATENCY_BUCKETS, registry=reg)  # fmt: skip
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_E2E_BUCKETS, registry=reg)  # fmt: skip
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens admitted", registry=reg
        )
        self.generation_tokens = Counter("pdserve_generation_tokens", "Output tokens", registry=reg)
        self.requests = Counter(
            "pdserve_requests", "Finished requests", ["finish_reason"], registry=reg
        )
        self.refused = Counter(
            "pdserve_requests_refused",
            "Requests answered 503: no worker could take them",
            registry=reg,
        )
        reg.register(_EngineCollector(client))
        gpu = _NvmlCollector.try_create() if nvml else None
        if gpu is not None:
            reg.register(gpu)

    def add_acceptor(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        """Count what the accept thread did (``HealthAcceptor.stats``)."""
        self.registry.register(_AcceptorCollector(stats))

    def add_connections(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        """Count connections held, refused and timed out (``ConnectionLimiter.stats``)."""
        self.registry.register(_ConnectionsCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
