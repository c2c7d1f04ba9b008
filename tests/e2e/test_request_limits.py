"""One request cannot tie up the server (issue 37), on a launched 1P/1D server.

Each case a hostile probe found (tool call arguments nested 2,000 and 50,000 levels, a
Messages output schema nested 100 and 700 levels, a forced tool's 100 KB schema, 4.5 MB
of tools, a schema that compiles for longer than the budget) is a 400 in its API's shape
naming the limit, within ``ANSWER_S``; ``/metrics`` counts each refusal by limit. A
heavy but valid schema compiles once (the second request is a cache hit), and while a
schema compiles up to its budget, other clients' plain requests keep their idle latency.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.conftest import TOOLS_TEMPLATE
from tests.e2e.helpers import children, pid_of, title

MODEL = "tiny"
# NOTE: above the default (5 s): this suite shares its cores with other jobs, and a
# compile that takes 1.5 s alone (``heavy_schema(1)``) must stay within the budget.
BUDGET_S = 8.0
ANSWER_S = BUDGET_S + 4.0  # a refusal comes within the budget, plus slack
SMALL = [
    *shlex.split(
        "--prefill 1 --decode 1 --detokenizers 1 --device cpu --kv-cache-tokens 4096 --max-model-len 512 --served-model-name"
    ),
    MODEL,
    "--chat-template",
    str(TOOLS_TEMPLATE),
    "--grammar-compile-timeout",
    str(BUDGET_S),
]


@pytest.fixture(scope="module")
def srv() -> Iterator[LaunchedServer]:
    for s in LaunchedServer.serving(SMALL):
        # No grammar worker before the first grammar (it holds ~200 MiB a frontend).
        assert grammar_workers(s) == set()
        # A first grammar: its worker process is up (the bounds below time compiles, not
        # the start of the worker that runs them).
        r = post(s, "/v1/chat/completions", chat(response_format={"type": "json_object"}))
        assert r.status_code == 200, r.text
        yield s


def post(srv: LaunchedServer, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        srv.url + path,
        content=content,
        timeout=timeout,
        headers={"content-type": "application/json"},
    )


def refused(r: httpx.Response, path: str, limit: str) -> str:
    """The refusal's message, once checked: a 400 in ``path``'s API shape naming ``limit``
    and its flag."""
    assert r.status_code == 400, r.text
    payload = r.json()
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error", payload
        err = payload["error"]
    else:
        err = payload["error"]
        assert err["code"] == "limit_exceeded", payload
    assert err["type"] == "invalid_request_error", payload
    flag = "--" + limit.replace("_", "-")
    assert limit in err["message"] and flag in err["message"], payload
    return str(err["message"])


def deep_text(depth: int) -> str:
    return "[" * depth + "]" * depth


def chained_schema_text(levels: int) -> bytes:
    """A JSON schema nested ``levels`` objects deep, as text (deeper than ``json`` writes)."""
    return b'{"type":"object","properties":{"a":' * levels + b'{"type":"string"}' + b"}}" * levels


def heavy_schema(properties: int, salt: str = "") -> dict[str, Any]:
    """Valid and small, but about 1.5 s of compiling per property (string length bounds)."""
    props = {
        f"p{i}{salt}": {"type": "string", "minLength": 1000 + i, "maxLength": 2000 + i}
        for i in range(properties)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def refusals(srv: LaunchedServer) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_requests_refused_by_limit_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def metric(srv: LaunchedServer, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return float(next(ln.rsplit(" ", 1)[1] for ln in text.splitlines() if ln.startswith(name)))


@pytest.mark.parametrize("depth", [2_000, 50_000])
def test_deep_tool_call_arguments_are_a_400(srv: LaunchedServer, depth: int) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": deep_text(depth)},
    }
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    t0 = time.monotonic()
    r = post(srv, "/v1/chat/completions", chat(messages=turns))
    assert time.monotonic() - t0 < ANSWER_S
    refused(r, "/v1/chat/completions", "max_json_depth")
    assert r.json()["error"]["param"].startswith("messages[1].tool_calls[0].function.arguments")
    items = [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep_text(depth)},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
    ]
    r = post(srv, "/v1/responses", {"model": MODEL, "max_output_tokens": 4, "input": items})
    refused(r, "/v1/responses", "max_json_depth")
    assert r.json()["error"]["param"].startswith("input[1].arguments")


@pytest.mark.parametrize("levels", [100, 700])
def test_a_deep_messages_output_schema_is_a_400(srv: LaunchedServer, levels: int) -> None:
    body = (
        b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],'
        b' "output_config": {"format": {"type": "json_schema", "schema": '
        + chained_schema_text(levels)
        + b"}}}"
    )
    t0 = time.monotonic()
    r = post(srv, "/v1/messages", body)
    assert time.monotonic() - t0 < ANSWER_S
    refused(r, "/v1/messages", "max_json_depth")


def test_a_forced_tools_100_kb_schema_is_a_400(srv: LaunchedServer) -> None:
    props = {f"p{i}": {"type": "string", "description": "x" * 80} for i in range(1000)}
    tool = {"name": "f", "input_schema": {"type": "object", "properties": props}}
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "f"},
    }
    assert 90_000 < len(json.dumps(tool)) < 256 * 1024  # within --max-tools-bytes
    t0 = time.monotonic()
    r = post(srv, "/v1/messages", body)
    assert time.monotonic() - t0 < ANSWER_S
    assert "bytes" in refused(r, "/v1/messages", "max_schema_bytes")


def test_megabytes_of_tools_are_a_400(srv: LaunchedServer) -> None:
    props = {f"p{i}": {"type": "string", "description": "x" * 80} for i in range(45_000)}
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": props}},
    }
    t0 = time.monotonic()
    r = post(srv, "/v1/chat/completions", chat(tools=[tool], tool_choice="required"))
    assert time.monotonic() - t0 < ANSWER_S
    refused(r, "/v1/chat/completions", "max_tools_bytes")
    assert r.json()["error"]["param"] == "tools"


def grammar_workers(srv: LaunchedServer) -> set[int]:
    """The pids of the server's grammar compile processes (the frontend's children)."""
    frontend = pid_of(srv, "pdserve:frontend-0")
    return {pid for pid in children(frontend) if title(pid) == "pdserve:grammar"}


# A schema whose compile outlasts the budget.
HEAVY_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": heavy_schema(16)}}


def test_a_schema_over_the_compile_budget_is_abandoned_and_a_400(srv: LaunchedServer) -> None:
    before = grammar_workers(srv)
    t0 = time.monotonic()
    r = post(
        srv,
        "/v1/chat/completions",
        chat(response_format=HEAVY_FORMAT),
    )
    assert BUDGET_S <= time.monotonic() - t0 < ANSWER_S
    assert "abandoned" in refused(r, "/v1/chat/completions", "grammar_compile_timeout")
    # The compile did not go on behind the answer: the process that ran it is gone.
    deadline = time.monotonic() + 5
    while not before - grammar_workers(srv) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert before - grammar_workers(srv), "the abandoned compile's process still runs"
    # The same schema again is refused at once, from the cache of verdicts.
    t0 = time.monotonic()
    r = post(
        srv,
        "/v1/chat/completions",
        chat(response_format=HEAVY_FORMAT),
    )
    refused(r, "/v1/chat/completions", "grammar_compile_timeout")
    assert time.monotonic() - t0 < BUDGET_S


def test_a_repeated_heavy_schema_compiles_once(srv: LaunchedServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": heavy_schema(1, "c")}}
    compiles = metric(srv, "pdserve_grammar_compiles_total")
    hits = metric(srv, "pdserve_grammar_cache_hits_total")
    for _ in range(2):
        r = post(srv, "/v1/chat/completions", chat(response_format=fmt, max_tokens=2))
        assert r.status_code == 200, r.text
    assert metric(srv, "pdserve_grammar_compiles_total") == compiles + 1
    assert metric(srv, "pdserve_grammar_cache_hits_total") >= hits + 1


def plain_latencies(srv: LaunchedServer, n: int = 20) -> list[float]:
    """``n`` plain requests one after another, each from a new client (connection)."""
    out = []
    for i in range(n):
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            t0 = time.monotonic()
            r = c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4, "temperature": 0},
            )
            out.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
    return out


def busy_and_idle_p50(srv: LaunchedServer, salt: str) -> tuple[float, float, bool]:
    """(p50 idle, p50 while a schema compiles up to the budget, whether all 20, and a
    structured request after them, were answered inside the compile)."""
    idle = statistics.median(plain_latencies(srv))
    answer: list[httpx.Response] = []
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": heavy_schema(16, salt)}}
    heavy = threading.Thread(
        target=lambda: answer.append(post(srv, "/v1/chat/completions", chat(response_format=fmt)))
    )
    compiles = metric(srv, "pdserve_grammar_compiles_total")
    heavy.start()
    # Bounded: a grammar worker replacing one killed earlier may still be loading.
    deadline = time.monotonic() + 60
    while metric(srv, "pdserve_grammar_compiles_total") == compiles:  # the compile started
        assert time.monotonic() < deadline
        time.sleep(0.02)
    busy = statistics.median(plain_latencies(srv))
    # A structured request of another client compiles beside it (another grammar worker).
    small = {"type": "object", "properties": {f"n{salt}": {"type": "integer"}}}
    other = {"type": "json_schema", "json_schema": {"name": "s", "schema": small}}
    r = post(srv, "/v1/chat/completions", chat(response_format=other, max_tokens=8))
    assert r.status_code == 200, r.text
    inside = not answer  # the heavy request was still compiling when these were done
    heavy.join(ANSWER_S)
    refused(answer[0], "/v1/chat/completions", "grammar_compile_timeout")
    return idle, busy, inside


def test_plain_requests_keep_their_latency_while_a_schema_compiles(srv: LaunchedServer) -> None:
    """p50 of 20 plain requests within 1.5x of an idle server's, measured in the same test.

    NOTE: this machine's cores are shared with other jobs, so one measurement may be
    disturbed by them: up to 3 rounds (each its own idle baseline and a schema of its
    own, as a timeout is cached), and one that holds is enough. A frontend that blocked on
    the compile would fail every round by seconds, not by a ratio.
    """
    rounds = []
    for attempt in range(3):
        idle, busy, inside = busy_and_idle_p50(srv, f"r{attempt}-{os.getpid()}")
        rounds.append((round(idle, 4), round(busy, 4), inside))
        if inside and busy <= 1.5 * idle:
            print(f"p50 idle {idle:.4f} s, while compiling {busy:.4f} s: {busy / idle:.2f}x")
            return
    pytest.fail(f"(idle p50 s, busy p50 s, inside the compile) per round: {rounds}")


def test_metrics_count_refusals_per_limit(srv: LaunchedServer) -> None:
    before = refusals(srv)
    assert set(before) == {
        "max_json_depth",
        "max_tools_bytes",
        "max_schema_bytes",
        "grammar_compile_timeout",
    }
    refused(
        post(srv, "/v1/completions", b'{"prompt": ' + deep_text(80).encode() + b"}"),
        "/v1/completions",
        "max_json_depth",
    )
    after = refusals(srv)
    assert after["max_json_depth"] == before["max_json_depth"] + 1
    assert all(after[k] == before[k] for k in before if k != "max_json_depth")
