"""What several end-to-end tests do to a launched server: drive it and read its state."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from hypothesis import HealthCheck, settings

from benchmarks.harness.processes import parents
from tests.conftest import LaunchedServer

# The hypothesis settings of the hand-written e2e fuzz tests: reproducible (derandomized, no
# example database) and never failed for being slow, since every example is an HTTP round trip.
E2E_FUZZ = settings(
    max_examples=50,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


async def concurrent_greedy(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:  # type: ignore[type-arg]
    """POST every prompt to /generate at once (greedy, ignore_eos); the JSON responses."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(ids: list[int]) -> dict:  # type: ignore[type-arg]
            body = {
                "input_ids": ids,
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            }
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            return r.json()  # type: ignore[no-any-return]

        return await asyncio.gather(*(one(p) for p in prompts))


def check_greedy_matches_transformers(
    server: LaunchedServer, model: Path, prompts: list[list[int]], max_tokens: int
) -> None:
    """Every prompt at once through /generate: each answer is transformers' greedy
    continuation of its prompt, token for token."""
    from transformers import AutoModelForCausalLM

    results = asyncio.run(concurrent_greedy(server.url, prompts, max_tokens))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for prompt, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == hf_greedy(hf, prompt, max_tokens)


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """A transformers (or peft) model's greedy continuation of ``prompt``, EOS ignored:
    ``max_tokens`` ids."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def greedy_chat_ids(
    server: LaunchedServer, model: str, messages: list[Any], max_tokens: int
) -> list[int]:
    """The token ids a greedy chat completion of ``messages`` generates (its
    ``return_token_ids``): what another API's answer to the same conversation must count."""
    import openai

    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = chat.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return done.choices[0].model_extra["token_ids"]  # type: ignore[index,no-any-return]


def kv_by_worker(server: LaunchedServer) -> dict[str, int]:
    """KV blocks each worker with a KV pool holds, by ``role-index`` (from /health)."""
    return {
        f"{w['role']}-{w['index']}": int(w["load"]["total_kv_blocks"] - w["load"]["free_kv_blocks"])
        for w in server.health()["workers"]
        if "total_kv_blocks" in w["load"]
    }


def kv_in_use(server: LaunchedServer) -> int:
    """KV blocks held, summed over every worker (from /health)."""
    return sum(kv_by_worker(server).values())


def read_events_then_leave(server: LaunchedServer, r: httpx.Response, events: int = 5) -> None:
    """Read ``events`` data lines of the open stream ``r`` (KV is in use by then); the
    caller's closing the stream then disconnects the client."""
    seen = 0
    for line in r.iter_lines():
        seen += line.startswith("data: ")
        if seen >= events:
            assert kv_in_use(server) > 0
            return


def check_abort_mid_stream_frees_kv(server: LaunchedServer) -> None:
    """A client that leaves a long stream has its KV back to zero within 5 s."""
    body = {
        "input_ids": [5] * 40,
        "stream": True,
        "sampling_params": {"max_tokens": 800, "temperature": 0, "ignore_eos": True},
    }
    with httpx.Client(base_url=server.url) as client:
        with client.stream("POST", "/generate", json=body, timeout=60) as r:
            read_events_then_leave(server, r)
        wait_kv_free(server)


def reported_pids(server: LaunchedServer, timeout_s: float = 30.0) -> dict[tuple[str, int], int]:
    """Every worker's pid, once each has reported one (a detokenizer shard may report
    its pid a moment after the server says it is serving)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = {(w["role"], w["index"]): w["pid"] for w in server.health()["workers"]}
        if all(pids.values()) or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def computed_prefill_tokens(server: LaunchedServer) -> int:
    """Prompt tokens the prefill workers have run through the model (from /metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(
        r'^pdserve_prefill_computed_tokens_total\{[^}]*role="prefill"[^}]*\} (\S+)$', text, re.M
    )
    assert found, text
    return int(sum(float(v) for v in found))


def wait_kv_free(server: LaunchedServer, timeout_s: float = 5.0, what: str = "") -> None:
    """Every worker's KV blocks back within ``timeout_s`` (a request that left was aborted
    everywhere); ``what`` leads the failure message."""
    deadline = time.monotonic() + timeout_s
    while kv_in_use(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert kv_in_use(server) == 0, f"{what}KV still held: {kv_by_worker(server)}"


def wait_logged(server: LaunchedServer, needle: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(needle in line for line in server.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(needle in line for line in server.log), needle


def render_ids(
    tokenizer: Any,
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """A conversation as the server's chat template renders and tokenizes it."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    return [child for child, parent in parents().items() if parent == pid]


def title(pid: int) -> str:
    """A process's title (its argv[0], as setproctitle sets it)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()


def pid_of(server: LaunchedServer, name: str) -> int:
    """The pid of the server's child titled ``name`` (``pdserve:decode-0``, ...)."""
    for pid in children(server.proc.pid):
        if title(pid) == name:
            return pid
    raise AssertionError(f"no process titled {name}")


GREEDY_TOKENS = 120  # what greedy_stream asks for, and want_greedy computes


def want_greedy(
    reference: dict[tuple[int, ...], list[int]], model: Path, prompt: list[int]
) -> list[int]:
    """Greedy continuation from transformers, computed once per prompt into ``reference``."""
    key = tuple(prompt)
    if key not in reference:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        reference[key] = hf_greedy(hf, prompt, GREEDY_TOKENS)
    return reference[key]


async def greedy_stream(
    client: httpx.AsyncClient, prompt: list[int], started: asyncio.Event
) -> dict:  # type: ignore[type-arg]
    """One streamed greedy /generate; ``started`` is set once 8 tokens have come. The
    result says which frontend served it, and the error if the connection broke."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    out: dict = {"text": "", "ids": [], "finish": None, "frontend": None, "error": None}  # type: ignore[type-arg]
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            out["frontend"] = r.headers.get("x-pdserve-frontend")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                out["text"] += chunk["text"]
                out["ids"] += chunk["output_ids"]
                out["finish"] = chunk.get("finish_reason") or out["finish"]
                if len(out["ids"]) >= 8:
                    started.set()
    except httpx.TransportError as e:
        out["error"] = repr(e)
    return out


def run_with_kill(server: LaunchedServer, prompts: list[list[int]], *titles: str) -> list[dict]:  # type: ignore[type-arg]
    """Stream every prompt at once; SIGKILL the processes titled ``titles`` once tokens
    flow; every stream's result."""

    async def main() -> list[dict]:  # type: ignore[type-arg]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started = asyncio.Event()
            tasks = [asyncio.create_task(greedy_stream(client, p, started)) for p in prompts]
            await asyncio.wait_for(started.wait(), 60)
            for name in titles:
                os.kill(pid_of(server, name), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 100)

    return asyncio.run(main())


def check_exact(
    results: list[dict],
    prompts: list[list[int]],
    reference: dict,  # type: ignore[type-arg]
    model: Path,
    tokenizer: object,
    log: list[str],
) -> None:
    """Each result is the whole greedy continuation of its prompt: nothing lost or repeated."""
    events = [line for line in log if "resumed" in line or "exited" in line or "failed" in line]
    for prompt, result in zip(prompts, results, strict=True):
        want = want_greedy(reference, model, prompt)
        assert result["finish"] == "length", (result, events[-20:])
        assert result["ids"] == want, f"prompt of {len(prompt)}: {events[-20:]}"
        assert result["text"] == tokenizer.decode(want, skip_special_tokens=True)  # type: ignore[attr-defined]


@dataclass
class Exact:
    """``check_exact`` against the default tiny model: the ``exact`` fixture, whose
    greedy continuations are computed once per prompt for its module."""

    model: Path
    tokenizer: Any
    reference: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def check(self, results: list[dict], prompts: list[list[int]], log: list[str]) -> None:  # type: ignore[type-arg]
        check_exact(results, prompts, self.reference, self.model, self.tokenizer, log)

    def survives_kill(self, server: LaunchedServer, n: int, seed: int, *titles: str) -> list[dict]:  # type: ignore[type-arg]
        """Stream ``n`` random prompts and SIGKILL the processes titled ``titles`` once
        tokens flow: every stream is still its prompt's whole greedy continuation, and
        every worker is back afterwards. The streams' results."""
        wait_all_alive(server)
        prompts = random_prompts(n, seed)
        results = run_with_kill(server, prompts, *titles)
        self.check(results, prompts, server.log)
        wait_all_alive(server)
        return results


def wait_all_alive(server: LaunchedServer, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(w["alive"] for w in server.health()["workers"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"workers not all back: {server.health()}")


def random_prompts(n: int, seed: int, first: int = 5, step: int = 9) -> list[list[int]]:
    """``n`` prompts of random Qwen2-vocabulary ids, of ``first``, ``first + step``, ...
    tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150_000, (first + step * i,), generator=g).tolist() for i in range(n)]


# The tool every tool-calling e2e test offers, in each API's wrapping around it.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def leave_mid_stream(
    server: LaunchedServer,
    path: str,
    body: dict[str, Any],
    delta_event: str,
    rid_of: Callable[[dict[str, Any]], int],
) -> None:
    """Open a stream, read 5 deltas (KV is in use), close it; the request must be
    aborted (logged as such, not finished on its own) and its KV freed."""
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", path, json=body) as r,
    ):
        deltas, rid = 0, None
        for line in r.iter_lines():
            if line.startswith("data: ") and rid is None:
                rid = rid_of(json.loads(line[6:]))
            deltas += line == f"event: {delta_event}"
            if deltas == 5:
                assert kv_in_use(server) > 0
                break  # closing the stream disconnects the client
    wait_logged(server, f"rid={rid} aborted")
    wait_kv_free(server)
