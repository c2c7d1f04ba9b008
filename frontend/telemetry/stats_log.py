"""A periodic stats line while there is traffic, as operators of vLLM know it:

    prompt 812.4 tok/s, generation 96.0 tok/s, running 8 reqs, waiting 0 reqs, KV 3.1%

Throughput is over the last interval, from the frontend's own counters; running, waiting
and KV use are summed over the workers' load-table rows. Nothing is logged while idle.
"""

from __future__ import annotations

import asyncio
import logging
import time

from frontend.engine_link.engine_client import EngineClient
from frontend.telemetry.metrics import FrontendMetrics

logger = logging.getLogger("pdserve.stats")

INTERVAL_S = 10.0


class StatsLog:
    def __init__(self, client: EngineClient, metrics: FrontendMetrics) -> None:
        self.client, self.metrics = client, metrics
        self._last = (time.monotonic(), *self._totals())

    def _totals(self) -> tuple[float, float]:
        reg = self.metrics.registry
        prompt = reg.get_sample_value("pdserve_prompt_tokens_total") or 0.0
        generated = reg.get_sample_value("pdserve_generation_tokens_total") or 0.0
        return prompt, generated

    def line(self) -> str | None:
        """This interval's line, or None when nothing ran or waited in it."""
        now, (prompt, generated) = time.monotonic(), self._totals()
        then, prompt0, generated0 = self._last
        self._last = (now, prompt, generated)
        workers = self.client.metrics_snapshot()
        running = sum(w.load.running_requests for w in workers)
        waiting = sum(w.load.waiting_requests for w in workers)
        if prompt == prompt0 and generated == generated0 and not running and not waiting:
            return None
        kv = max((w.load.kv_usage for w in workers), default=0.0)
        dt = max(now - then, 1e-9)
        return (
            f"prompt {(prompt - prompt0) / dt:.1f} tok/s, generation "
            f"{(generated - generated0) / dt:.1f} tok/s, running {running} reqs, waiting "
            f"{waiting} reqs, KV {100 * kv:.1f}% (fullest worker)"
        )

    async def run(self, interval_s: float = INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                text = self.line()
            except Exception:  # a stats line must never take the server down
                logger.exception("stats line failed")
                continue
            if text is not None:
                logger.info("%s", text)
