"""Client-side serving metrics, computed from per-request records. Pure: no I/O.

Definitions (per request, from the SSE chunks the client saw):
    TTFT  send -> first chunk carrying content
    ITL   gaps between consecutive content chunks
    TPOT  (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output token
    E2EL  send -> end of the response
Throughputs divide by the benchmark's wall-clock duration. Goodput counts requests that
meet every given SLO (ms), per second. Field names follow ``vllm bench serve``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What one request did, as measured by the client (seconds)."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where reported

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad --goodput item {spec!r}: use ttft:MS, tpot:MS or e2el:MS")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be positive, got {value}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return r.success and all(values[k] * 1000 <= ms for k, ms in slos.items())


def _stats(name: str, seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds, dtype=np.float64) * 1000 if seconds else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(
    records: list[RequestRecord],
    duration: float,
    percentiles: list[float],
    slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The result dictionary of one run (without the run's configuration)."""
    duration = max(duration, 1e-9)
    ok = [r for r in records if r.success]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    errors = collections.Counter(r.error for r in records if not r.success)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached,
        "prefix_cache_hit_rate": total_cached / total_in if total_in else 0.0,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": (sum(meets_slos(r, slos) for r in ok) / duration if slos else None),
        "errors_summary": dict(errors.most_common()),
    }
    for name in METRICS:
        result.update(_stats(name, series[name], percentiles))
    result.update(
        input_lens=[r.prompt_len for r in records],
        output_lens=[r.output_tokens for r in records],
        ttfts=[r.ttft for r in records],
        itls=[r.itl for r in records],
        errors=[r.error for r in records],
    )
    return result
