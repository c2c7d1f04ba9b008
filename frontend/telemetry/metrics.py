"""Prometheus metrics of the server, as any of its frontends shows them.

Latencies are measured here, at the HTTP boundary, so they include queueing, transfer
and detokenization. Engine load (running/waiting/KV usage per worker) is read from the
engine client at scrape time; GPU utilisation and memory come from NVML when a driver is
present. Each app owns its registry, so several apps can live in one process (tests).

Several frontends (``launch --api-workers N``), one server: each frontend counts into its
own row of the frontends' board (``frontend/engine_link/board.py``, shared memory), and
``/metrics`` from any of them shows the sum over all rows: one server, whichever process
the scrape reaches. Counters and histograms are summed (a restarted frontend goes on from
its predecessor's row, so they never go backwards); the connection gauge sums the live
frontends. ``pdserve_frontend_requests{frontend}`` alone is per frontend: how the
requests spread over them. The instruments are plain ``+=`` on float64 words of that row
(one writer per row), not prometheus_client objects, which live in one process.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from frontend.engine_link.board import METRIC_WORDS, FrontendBoard
from frontend.engine_link.engine_client import EngineClient
from frontend.errors import LIMITS
from frontend.telemetry.engine_metrics import EngineCollector
from frontend.telemetry.role_metrics import RoleCollector
from transport.load_table import WorkerState

logger = logging.getLogger(__name__)

# Histogram bounds in seconds. Kept as two-line tables (fmt: skip): the formatter would
# set them one number a line, 40 lines that read worse.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)  # fmt: skip


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


FINISH_REASONS = ("stop", "length", "abort", "error", "unknown")


class _Words:
    """Hands out consecutive words of a frontend's metric row."""

    def __init__(self) -> None:
        self.used = 0

    def take(self, n: int) -> int:
        first, self.used = self.used, self.used + n
        return first


class SharedCounter:
    __slots__ = ("_words", "index")

    def __init__(self, words: memoryview[float], index: int) -> None:
        self._words, self.index = words, index

    def inc(self, amount: float = 1.0) -> None:
        self._words[self.index] += amount


class SharedHistogram:
    """Bucket counts (not cumulative), then sum, then count."""

    __slots__ = ("_bounds", "_count", "_first", "_sum", "_words")

    def __init__(self, words: memoryview[float], first: int, bounds: Sequence[float]) -> None:
        self._words, self._first, self._bounds = words, first, tuple(bounds)
        self._sum = first + len(bounds) + 1
        self._count = self._sum + 1

    def observe(self, value: float) -> None:
        w = self._words
        w[self._first + bisect.bisect_left(self._bounds, value)] += 1  # le: value <= bound
        w[self._sum] += value
        w[self._count] += 1


class _Labelled:
    """Counters of one family, one per value of its single label."""

    def __init__(self, counters: dict[str, SharedCounter]) -> None:
        self._counters = counters

    def labels(self, **label: str) -> SharedCounter:
        (value,) = label.values()
        return self._counters[value]


@dataclass(frozen=True)
class _Family:
    name: str
    doc: str
    first: int
    bounds: tuple[float, ...] = ()  # histograms only


class FrontendMetrics:
    """The server's registry and the instruments this frontend's handlers update."""

    def __init__(self, client: EngineClient, *, nvml: bool = True) -> None:
        self.board = client.board if client.board is not None else FrontendBoard.private()
        w, words = _Words(), self.board.my_metrics()
        self._histograms: list[_Family] = []
        self._counters: list[_Family] = []

        def histogram(name: str, doc: str, bounds: tuple[float, ...]) -> SharedHistogram:
            f = _Family(name, doc, w.take(len(bounds) + 3), bounds)
            self._histograms.append(f)
            return SharedHistogram(words, f.first, bounds)

        def counter(name: str, doc: str) -> SharedCounter:
            f = _Family(name, doc, w.take(1))
            self._counters.append(f)
            return SharedCounter(words, f.first)

        self.ttft = histogram(
            "pdserve_time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds", "Gap between output deltas", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS
        )
        self.prompt_tokens = counter("pdserve_prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("pdserve_generation_tokens", "Output tokens")
        self.refused = counter(
            "pdserve_requests_refused", "Requests answered 503: no worker could take them"
        )
        self.poisoned = counter(
            "pdserve_requests_poisoned",
            "Requests ended as poison: blamed for more worker deaths than their retries allow",
        )
        client.on_poisoned = self.poisoned.inc
        self._requests = w.take(len(FINISH_REASONS))
        self.requests = _Labelled(
            {r: SharedCounter(words, self._requests + i) for i, r in enumerate(FINISH_REASONS)}
        )
        self._by_limit = w.take(len(LIMITS))
        self.limit_refusals = _Labelled(
            {name: SharedCounter(words, self._by_limit + i) for i, name in enumerate(LIMITS)}
        )
        self.grammar_compiles = counter(
            "pdserve_grammar_compiles", "Grammars compiled to check a request (cache misses)"
        )
        self.grammar_cache_hits = counter(
            "pdserve_grammar_cache_hits", "Grammar checks answered from the cache of verdicts"
        )
        # Process-local figures, copied in by ``publish`` (the accept thread counts in C).
        self._accepted = counter("pdserve_http_connections_accepted", "TCP connections accepted")
        self._answered = counter(
            "pdserve_health_probes_answered",
            "GET /health probes answered by the accept thread, off the event loop",
        )
        self._conn_refused = counter(
            "pdserve_http_connections_refused",
            "Connections refused with 503: over --max-connections(-per-peer)",
        )
        self._timeouts = counter(
            "pdserve_http_request_timeouts",
            "Connections closed because a request head or body came too slowly",
        )
        self._held = w.take(1)
        assert w.used <= METRIC_WORDS, f"{w.used} metric words; the board has {METRIC_WORDS}"
        self._words = words
        # A restarted frontend's copied counters start from its predecessor's totals.
        copied = (self._accepted, self._answered, self._conn_refused, self._timeouts)
        self._base = {c.index: words[c.index] for c in copied}
        self._acceptor: Callable[[], tuple[int, int, int]] | None = None
        self._connections: Callable[[], tuple[int, int, int]] | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_SharedCollector(self))
        self.registry.register(EngineCollector(client))
        if client.role_control is not None:  # launch --workers
            self.registry.register(RoleCollector(client.role_control.table))
        gpu = _NvmlCollector.try_create() if nvml else None
        if gpu is not None:
            self.registry.register(gpu)

    def add_acceptor(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        """Count what the accept thread did (``HealthAcceptor.stats``)."""
        self._acceptor = stats

    def add_connections(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        """Count connections held, refused and timed out (``ConnectionLimiter.stats``)."""
        self._connections = stats

    def publish(self) -> None:
        """Copy this process's own figures (accept thread, connections) into its row."""
        w, base = self._words, self._base
        copies: list[tuple[SharedCounter, int]] = []
        if self._acceptor is not None:
            accepted, answered, _ = self._acceptor()
            copies += [(self._accepted, accepted), (self._answered, answered)]
        if self._connections is not None:
            held, refused, timed_out = self._connections()
            w[self._held] = held
            copies += [(self._conn_refused, refused), (self._timeouts, timed_out)]
        for counter, value in copies:
            w[counter.index] = base[counter.index] + value

    async def publish_every(self, interval_s: float = 1.0) -> None:
        """Keep this row's copied figures fresh for scrapes another frontend answers."""
        while True:
            self.publish()
            await asyncio.sleep(interval_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _by_label(
    name: str, doc: str, label: str, samples: Iterable[tuple[str, float]]
) -> CounterMetricFamily:
    """A counter family with one sample per ``(label value, count)``."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in samples:
        family.add_metric([value], float(count))
    return family


class _SharedCollector(Collector):
    """The frontends' rows, summed: one server."""

    def __init__(self, m: FrontendMetrics) -> None:
        self._m = m

    def collect(self) -> Iterator[Metric]:
        m = self._m
        m.publish()
        rows = m.board.metrics.copy()  # (frontends, words)
        total = rows.sum(axis=0)
        for f in m._histograms:
            n = len(f.bounds) + 1
            cumulative = np.cumsum(total[f.first : f.first + n])
            buckets = [
                (_le(b), float(c)) for b, c in zip((*f.bounds, None), cumulative, strict=True)
            ]
            yield HistogramMetricFamily(
                f.name, f.doc, buckets=buckets, sum_value=float(total[f.first + n])
            )
        for f in m._counters:
            yield CounterMetricFamily(f.name, f.doc, value=float(total[f.first]))
        finished = total[m._requests : m._requests + len(FINISH_REASONS)]
        yield _by_label(
            "pdserve_requests",
            "Finished requests",
            "finish_reason",
            ((reason, n) for reason, n in zip(FINISH_REASONS, finished, strict=True) if n),
        )
        yield _by_label(
            "pdserve_requests_refused_by_limit",
            "Requests answered 400 for going over a limit (docs/reliability.md)",
            "limit",
            zip(LIMITS, total[m._by_limit : m._by_limit + len(LIMITS)], strict=True),
        )
        done = rows[:, m._requests : m._requests + len(FINISH_REASONS)].sum(axis=1)
        yield _by_label(
            "pdserve_frontend_requests",
            "Finished requests, by the frontend that served them",
            "frontend",
            ((str(n), count) for n, count in enumerate(done)),
        )
        live = [r.state == WorkerState.READY or r.index == m.board.me for r in m.board.frontends()]
        yield GaugeMetricFamily(
            "pdserve_http_connections_open",
            "Client connections held",
            value=float(rows[live, m._held].sum()),
        )


def _le(bound: float | None) -> str:
    return "+Inf" if bound is None else floatToGoString(bound)
