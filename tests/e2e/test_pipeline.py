"""The launched disaggregated server, end to end (issue: the pipeline's done-means)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.conftest import LaunchedServer
from tests.e2e.helpers import (
    check_abort_mid_stream_frees_kv,
    check_greedy_matches_transformers,
    random_prompts,
)


def _generate(client: httpx.Client, ids: list[int], max_tokens: int, stream: bool) -> dict:  # type: ignore[type-arg]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }
    if not stream:
        r = client.post("/generate", json=body, timeout=300)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]
    text, ids_out = "", []
    with client.stream("POST", "/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["text"]
            ids_out += chunk["output_ids"]
    return {"text": text, "output_ids": ids_out}


def test_32_concurrent_greedy_requests_match_transformers(
    server: LaunchedServer, default_model_path: Path
) -> None:
    prompts = random_prompts(32, seed=3, first=1, step=7)
    check_greedy_matches_transformers(server, default_model_path, prompts, max_tokens=16)
    health = server.health()
    assert all(w["alive"] for w in health["workers"])


def test_streamed_text_equals_non_streamed(server: LaunchedServer) -> None:
    with httpx.Client(base_url=server.url) as client:
        for n in (1, 30):
            ids = list(range(1000, 1000 + n))
            whole = _generate(client, ids, 24, stream=False)
            streamed = _generate(client, ids, 24, stream=True)
            assert streamed["text"] == whole["text"]
            assert streamed["output_ids"] == whole["output_ids"]


def test_abort_mid_stream_frees_kv(server: LaunchedServer) -> None:
    check_abort_mid_stream_frees_kv(server)
