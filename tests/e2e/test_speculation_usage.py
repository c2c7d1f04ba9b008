"""Per-request speculation counts served: OpenAI's usage, on opt-in, against /metrics.

1P1D on the tiny checkpoint, speculating with a draft model that is the target itself:
every draft is right (greedy), so drafts are verified and accepted for real although
the random weights never repeat themselves (n-gram lookup would find nothing). With
the gate off, every step verifies K drafts (fewer near max_tokens), so the counts of a
request are known exactly (``_all_right``). A request
that sends ``return_prediction_tokens_details: true`` gets
``usage.completion_tokens_details.accepted_prediction_tokens``/``rejected_prediction_tokens``
(the streaming final usage chunk too); one that does not gets no such fields.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.peers.speculative import speculation_counts
from tests.conftest import LaunchedServer

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8] * 10
K = 4
MAX = 24  # tokens a request generates
OPT_IN = {"return_prediction_tokens_details": True}


@pytest.fixture(scope="module")
def speculative_server(default_model_path: Path) -> Iterator[LaunchedServer]:
    # Not adaptive: every step verifies K drafts (the cost-aware gate would decide by
    # this machine's timings whether a request speculates).
    spec = {
        "method": "draft_model",
        "model": str(default_model_path),
        "num_speculative_tokens": K,
        "adaptive": False,
    }
    yield from LaunchedServer.serving(
        [
            *shlex.split("--prefill 1 --decode 1 --device cpu --kv-cache-tokens 4096"),
            *shlex.split("--max-model-len 512 --speculative-config"),
            json.dumps(spec),
        ]
    )


def _settled(url: str, before: tuple[float, float], drafted: int) -> tuple[float, float]:
    """The engine's counts since ``before``, once its load-table row shows at least
    ``drafted`` more drafts (it publishes every step; the request may end first)."""
    deadline = time.monotonic() + 10
    while True:
        now = speculation_counts(url)
        delta = (now[0] - before[0], now[1] - before[1])
        if delta[0] >= drafted or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def _all_right(n: int, max_tokens: int) -> tuple[int, int]:
    """(drafted, accepted) of an output of ``n`` tokens when every draft is right: the
    first token is prefill's; each step verifies up to K drafts (none past max_tokens)
    and emits them and the token sampled after them, cut where the output ends."""
    drafted = accepted = 0
    pos = 1
    while pos < n:
        k = max(0, min(K, max_tokens - pos - 1))
        drafted += k
        accepted += min(k, n - pos)
        pos += k + 1
    return drafted, accepted


def _complete(url: str, **body: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, **body}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _details(usage: dict[str, Any]) -> tuple[int, int]:
    d = usage["completion_tokens_details"]
    return d["accepted_prediction_tokens"], d["rejected_prediction_tokens"]


def test_counts_of_a_request_agree_with_the_engines_metrics(
    speculative_server: LaunchedServer,
) -> None:
    url = speculative_server.url
    before = speculation_counts(url)
    out = _complete(url, **OPT_IN)
    accepted, rejected = _details(out["usage"])
    drafted, engine_accepted = _settled(url, before, accepted + rejected)
    assert out["choices"][0]["finish_reason"] == "length"
    assert (accepted + rejected, accepted) == _all_right(MAX, MAX)  # all drafts right
    assert (accepted + rejected, accepted) == (drafted, engine_accepted)
    assert accepted < out["usage"]["completion_tokens"]  # prefill's token is no draft


def test_without_opt_in_the_fields_are_absent(speculative_server: LaunchedServer) -> None:
    out = _complete(speculative_server.url)
    assert "completion_tokens_details" not in out["usage"]
    opted = _complete(speculative_server.url, **OPT_IN)
    assert opted["choices"][0]["text"] == out["choices"][0]["text"]


def test_a_stop_token_inside_an_accepted_run(speculative_server: LaunchedServer) -> None:
    """The engine verifies the whole run and counts it accepted; the request ends at the
    stop, so the drafts after it are reported rejected: not in the completion."""
    url = speculative_server.url
    ids = _complete(url, return_token_ids=True)["choices"][0]["token_ids"]
    stop = next(t for t in ids[8:] if ids.index(t) >= 8)  # first occurrence past 8 tokens
    cut = ids.index(stop) + 1
    before = speculation_counts(url)
    out = _complete(url, stop_token_ids=[stop], return_token_ids=True, **OPT_IN)
    assert out["choices"][0]["token_ids"] == ids[:cut]
    assert out["choices"][0]["finish_reason"] == "stop"
    accepted, rejected = _details(out["usage"])
    drafted, engine_accepted = _settled(url, before, accepted + rejected)
    assert accepted + rejected == drafted == engine_accepted  # all drafts right
    assert (accepted + rejected, accepted) == _all_right(cut, MAX)
    assert cut == out["usage"]["completion_tokens"]
    if (cut - 2) % (K + 1) < K - 1:  # the stop is a draft with more drafts after it
        assert rejected > 0


def test_a_stop_string_inside_an_accepted_run(speculative_server: LaunchedServer) -> None:
    """Cut by the detokenizer: the decode worker may verify a step or more past it before
    it hears, none of which reaches the client's counts."""
    url = speculative_server.url
    full = _complete(url, return_token_ids=True)["choices"][0]
    tok = httpx.post(url + "/detokenize", json={"tokens": full["token_ids"][:12]}, timeout=30)
    text = tok.json()["prompt"]
    stop = text[-3:] if len(text) >= 6 else text  # ends inside the 12th token or so
    before = speculation_counts(url)
    out = _complete(url, stop=[stop], return_token_ids=True, **OPT_IN)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    n = out["usage"]["completion_tokens"]
    assert choice["token_ids"] == full["token_ids"][:n]
    accepted, rejected = _details(out["usage"])
    drafted, engine_accepted = _settled(url, before, accepted + rejected)
    assert 0 < accepted < n
    assert accepted + rejected <= drafted and accepted <= engine_accepted


def test_the_streaming_final_usage_chunk_carries_them(speculative_server: LaunchedServer) -> None:
    url = speculative_server.url
    want = _details(_complete(url, **OPT_IN)["usage"])
    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {
            **extra,
            "max_tokens": MAX,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **OPT_IN,
        }
        usages = []
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usages.append(json.loads(line[6:]).get("usage"))
        assert all(u is None for u in usages[:-1]) and usages[-1] is not None
        accepted, rejected = _details(usages[-1])
        assert accepted > 0 and rejected == 0
        if path == "/v1/completions":
            assert (accepted, rejected) == want == (_all_right(MAX, MAX)[1], 0)
