"""Speculative decoding served: 2P2D with n-gram speculation equals 1P1D without it.

SmolLM2 (the default model) on input-grounded prompts, where n-gram drafts are accepted
for real: text, token ids, logprobs, finish reasons and usage are the same with
speculation as without, stop strings included (they land inside accepted runs), the
decode workers count their drafts in /metrics, and a decode worker killed mid-stream
leaves every stream exact.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import run_with_kill, wait_all_alive

pytestmark = pytest.mark.slow
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
ARTICLE = (
    "The lighthouse at Point Arena stands 115 feet tall. It was rebuilt in 1908 after the "
    "earthquake of 1906 destroyed the original tower. The new tower was the first in the "
    "United States built of steel-reinforced concrete. Its first-order Fresnel lens, made "
    "in France, has 666 hand-ground prisms and weighs more than six tons. Visitors can "
    "climb the 145 steps to the top, where the view reaches the Pacific and the hills."
)
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
MESSAGES = [
    f"Repeat this text exactly:\n\n{ARTICLE}",
    f"Rename the function area to rect_area and return the whole file:\n\n{CODE}",
    f"From the text below, list every number it mentions.\n\n{ARTICLE}",
    "Tell me about your favourite season.",
]
SCHEMA = {
    "type": "object",
    "properties": {"height_feet": {"type": "integer"}, "rebuilt": {"type": "integer"}},
    "required": ["height_feet", "rebuilt"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LaunchedServer, LaunchedServer]]:
    # Dense float32 weights and KV cache: see docs/speculative.md on bfloat16 KV and logprobs.
    common = shlex.split(
        "--device cpu --kv-cache-tokens 16384 --max-model-len 2048 --quantization none"
    )
    speculating = LaunchedServer(
        [
            *shlex.split("--prefill 2 --decode 2 --detokenizers 2"),
            *common,
            "--speculative-config",
            NGRAM_CONFIG,
        ],
        tiny_model=False,
    )
    plain = LaunchedServer([*shlex.split("--prefill 1 --decode 1"), *common], tiny_model=False)
    try:
        speculating.wait_ready()
        plain.wait_ready()
        yield speculating, plain
    finally:
        speculating.stop()
        plain.stop()


def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat completion, its chunks folded: text, logprobs, finish, usage."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    out: dict[str, Any] = {"text": "", "choices": {}, "logprobs": [], "finish": None, "usage": None}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                i, content = choice["index"], choice["delta"].get("content") or ""
                out["choices"][i] = out["choices"].get(i, "") + content
                out["text"] += content if i == 0 else ""
                out["finish"] = choice.get("finish_reason") or out["finish"]
                if choice.get("logprobs"):
                    out["logprobs"] += choice["logprobs"]["content"]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["text"] == b["text"] and a["choices"] == b["choices"]
    assert (a["finish"], a["usage"]) == (b["finish"], b["usage"])
    assert len(a["logprobs"]) == len(b["logprobs"])
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        assert x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) < 1e-4
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        for t, u in zip(x["top_logprobs"], y["top_logprobs"], strict=True):
            assert abs(t["logprob"] - u["logprob"]) < 1e-4


def _bodies() -> list[dict[str, Any]]:
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    greedy = {"temperature": 0, "logprobs": True, "top_logprobs": 3}
    return [
        {"messages": user(MESSAGES[0]), "max_tokens": 48, **greedy},
        {"messages": user(MESSAGES[1]), "max_tokens": 24, **greedy},
        {
            "messages": user(MESSAGES[2]),
            "max_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 3,
        },
        {
            "messages": user(MESSAGES[3]),
            "max_tokens": 24,
            "temperature": 0.8,
            "top_k": 40,
            "seed": 4,
        },
        {
            "messages": user(MESSAGES[0]),
            "max_tokens": 24,
            "temperature": 0.8,
            "seed": 5,
            "n": 2,
            "presence_penalty": 0.5,
        },
        {
            "messages": user(f"Give the numbers as JSON.\n{ARTICLE}"),
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "f", "schema": SCHEMA},
            },
        },
    ]


@pytest.mark.timeout(600)  # SmolLM2 in float32 on two servers sharing the cores
def test_outputs_with_speculation_equal_outputs_without(
    servers: tuple[LaunchedServer, LaunchedServer],
) -> None:
    speculating, plain = servers
    for body in _bodies():
        want = _chat(plain.url, body)
        _same(_chat(speculating.url, body), want)
        if "response_format" in body:
            json.loads(want["text"])
    # Stop strings cut inside accepted runs: a word from the middle of the repeated text.
    base = _bodies()[0]
    text = _chat(plain.url, base)["text"]
    stops = [w for w in ("earthquake", "1906") if w in text]
    assert stops, text
    for word in stops:
        body = {**base, "stop": [word]}
        want = _chat(plain.url, body)
        assert want["finish"] == "stop" and word not in want["text"]
        _same(_chat(speculating.url, body), want)
    metrics = httpx.get(speculating.url + "/metrics", timeout=10).text
    accepted = re.findall(
        r'pdserve_spec_decode_num_accepted_tokens_total\{[^}]*role="decode"[^}]*\} (\S+)', metrics
    )
    assert accepted and sum(float(v) for v in accepted) > 0, metrics[-3000:]
    assert "pdserve_spec_decode_skipped_total" in metrics


@pytest.mark.timeout(600)
def test_concurrent_streams_equal_with_and_without_speculation(
    servers: tuple[LaunchedServer, LaunchedServer],
) -> None:
    """Four streams at once on each server (greedy and seeded, with logprobs): the same
    tokens, logprobs within 1e-4, whatever batches each server's steps made of them."""
    speculating, plain = servers
    greedy = {"temperature": 0, "logprobs": True, "top_logprobs": 2, "max_tokens": 20}
    seeded = {"temperature": 0.7, "seed": 9, "logprobs": True, "max_tokens": 20}
    bodies = [
        {"messages": [{"role": "user", "content": m}], **(greedy if i % 2 == 0 else seeded)}
        for i, m in enumerate(MESSAGES)
    ]

    def at_once(url: str) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(lambda b: _chat(url, b), bodies))

    for got, want in zip(at_once(speculating.url), at_once(plain.url), strict=True):
        # Streams racing for the prefix cache: what each found cached is not compared.
        for out in (got, want):
            out["usage"].pop("prompt_tokens_details", None)
        _same(got, want)


@pytest.mark.timeout(600)
def test_a_killed_decode_worker_leaves_speculating_streams_exact(
    servers: tuple[LaunchedServer, LaunchedServer],
) -> None:
    speculating, plain = servers
    wait_all_alive(speculating)
    tok = httpx.post(
        plain.url + "/tokenize", json={"prompt": ARTICLE + "\n\n" + ARTICLE}, timeout=30
    ).json()["tokens"]
    prompts = [tok[i * 7 :] for i in range(2)]  # input-grounded: drafts are accepted
    want = run_with_kill(plain, prompts)
    got = run_with_kill(speculating, prompts, "pdserve:decode-0")
    for g, w in zip(got, want, strict=True):
        assert g["error"] is None and g["finish"] == "length"
        assert (g["ids"], g["text"]) == (w["ids"], w["text"])
    wait_all_alive(speculating)
