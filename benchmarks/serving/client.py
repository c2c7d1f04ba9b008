"""One streamed request to an OpenAI-compatible server, timed per SSE chunk (over
``benchmarks/harness/http_stream.py``: a lean client, since it shares the cores with the
server it measures)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.http_stream import post_lines
from benchmarks.serving.datasets import SampleRequest
from benchmarks.serving.metrics import RequestRecord

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RequestConfig:
    base_url: str
    endpoint: str
    model: str
    ignore_eos: bool
    api_key: str | None = None
    timeout_s: float = 600.0


def build_body(cfg: RequestConfig, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "/v1/chat/completions":
        messages = req.messages or (("user", req.prompt),)
        body["messages"] = [{"role": role, "content": text} for role, text in messages]
    else:
        body["prompt"] = req.prompt
    return body


def _content(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


class ChunkTiming:
    """Chunk arrival times of one request."""

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record, self.start, self.last = record, start, start
        self.text: list[str] = []

    def on_payload(self, payload: dict[str, Any]) -> None:
        if "error" in payload:
            raise RuntimeError(f"server error event: {payload['error']}")
        usage = payload.get("usage")
        if usage:
            self.record.output_tokens = int(usage.get("completion_tokens") or 0)
            self.record.prompt_len = int(usage.get("prompt_tokens") or self.record.prompt_len)
            details = usage.get("prompt_tokens_details") or {}
            self.record.cached_tokens = int(details.get("cached_tokens") or 0)
        content = _content(payload)
        if not content:
            return
        now = time.perf_counter()
        if not self.text:
            self.record.ttft = now - self.start
        else:
            self.record.itl.append(now - self.last)
        self.last = now
        self.text.append(content)


async def send_request(
    cfg: RequestConfig,
    req: SampleRequest,
    tokenizer: Any,
    record: RequestRecord | None = None,
) -> RequestRecord:
    """Send ``req``; never raises: failures are recorded with their error. ``record``: the
    record to fill as chunks arrive (a caller that may cancel the request reads what it
    got so far there); default a new one. The caller bounds the request's time."""
    record = RequestRecord(prompt_len=req.prompt_len) if record is None else record
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = time.perf_counter()
    timing = ChunkTiming(record, start)
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    try:
        lines = post_lines(url, json.dumps(build_body(cfg, req)).encode(), headers)
        try:
            async for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                timing.on_payload(json.loads(data))
        finally:
            await lines.aclose()
        if not timing.text:
            raise RuntimeError("the response carried no content")
        record.latency = time.perf_counter() - start
        record.generated_text = "".join(timing.text)
        if record.output_tokens == 0:  # the server sent no usage: count ourselves
            ids = tokenizer.encode(record.generated_text, add_special_tokens=False)
            record.output_tokens = len(ids)
        record.success = True
    except Exception as e:  # every failure is data for the report, not a crash
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return record
