"""LoRA adapters through a real 1P1D server with two frontends: greedy parity per adapter
against transformers + peft, no cached block shared across adapters, load / unload / load
again, an adapter loaded or unloaded through one frontend seen by both, every bad input a
4xx with the server serving on, and decode-worker SIGKILL recovery."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bundled_models.lora import make_adapter, peft_model
from tests.conftest import LaunchedServer
from tests.e2e.helpers import hf_greedy, pid_of, random_prompts, wait_all_alive

# Not imported here: peft imports triton, and triton imported outside the Triton
# interpreter breaks the kernel tests that the same session runs later.
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)

MAX_TOKENS = 40
KINDS = {  # name -> (rank, targets)
    "qvd8": (8, ("q_proj", "v_proj", "down_proj")),
    "all16": (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "gu16": (16, ("gate_proj", "up_proj")),
}


@pytest.fixture(scope="module")
def adapters(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    out = {
        name: make_adapter(default_model_path, root / name, rank, targets, seed=i + 1)
        for i, (name, (rank, targets)) in enumerate(KINDS.items())
    }
    out["rank32"] = make_adapter(default_model_path, root / "rank32", 32, ("q_proj",), seed=9)
    qwen3 = default_model_path.parent / "tiny-qwen3-v1"  # q_proj 128 wide, not 64
    out["other_base"] = make_adapter(qwen3, root / "other_base", 4, ("q_proj",), seed=9)
    (root / "not_lora").mkdir()
    (root / "not_lora" / "weights.bin").write_bytes(b"\0" * 64)
    out["not_lora"] = root / "not_lora"
    return out


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        [
            *shlex.split(
                "--prefill 1 --decode 1 --detokenizers 1 --api-workers 2 --device cpu --kv-cache-tokens 8192 --max-model-len 1024 --stall-timeout 4 --enable-lora --max-loras 2 --max-lora-rank 16 --lora-modules"
            ),
            f"qvd8={adapters['qvd8']}",
        ]
    )


_reference: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _want(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    key = (str(adapter), tuple(prompt))
    if key not in _reference:
        if adapter is None:
            from transformers import AutoModelForCausalLM

            model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        else:
            model = peft_model(base, adapter)
        _reference[key] = hf_greedy(model, prompt, MAX_TOKENS)
    return _reference[key]


def _complete(srv: LaunchedServer, model: str, prompt: list[int], **extra: Any) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)


def _post(srv: LaunchedServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


@contextlib.contextmanager
def _loaded(srv: LaunchedServer, name: str, path: Path) -> Iterator[None]:
    """The adapter at ``path`` loaded as ``name`` for the ``with`` block, unloaded after."""
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text
    try:
        yield
    finally:
        _post(srv, "/v1/unload_lora_adapter", {"lora_name": name})


def _base_name(srv: LaunchedServer) -> str:
    return str(httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"])


def _assert_serving(srv: LaunchedServer) -> None:
    assert srv.health()["status"] == "ok"
    assert _complete(srv, _base_name(srv), [1, 2, 3], max_tokens=2).status_code == 200


def test_an_adapter_loaded_through_one_frontend_serves_through_both(
    server: LaunchedServer, adapters: dict[str, Path]
) -> None:
    # Each request on a new connection: the port's two frontends take them in turn.
    with _loaded(server, "both", adapters["gu16"]):
        seen: set[str] = set()
        for _ in range(40):
            r = _complete(server, "both", [1, 2, 3], max_tokens=2)
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-pdserve-frontend"])
            if seen == {"0", "1"}:
                break
        assert seen == {"0", "1"}
    for _ in range(10):  # unloaded through whichever frontend took it: gone from both
        assert _complete(server, "both", [1, 2, 3], max_tokens=2).status_code == 404


def test_models_lists_each_adapter_with_the_base_as_parent(server: LaunchedServer) -> None:
    data = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    base = data[0]["id"]
    assert [(d["id"], d.get("parent")) for d in data[1:]] == [("qvd8", base)]


def test_greedy_output_per_adapter_matches_transformers_peft(
    server: LaunchedServer, adapters: dict[str, Path], default_model_path: Path
) -> None:
    with _loaded(server, "all16", adapters["all16"]):
        prompt = random_prompts(1, seed=4)[0] + [11, 12, 13]
        outs = {}
        for name in ("qvd8", "all16", None):
            r = _complete(server, name or _base_name(server), prompt)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["token_ids"]
            assert got == _want(default_model_path, adapters.get(name or ""), prompt), name
            outs[name] = got
        assert len({tuple(v) for v in outs.values()}) == 3, "an adapter changed nothing"

        # Several adapters and the base in flight at once: each as alone.
        async def all_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                bodies = [
                    {
                        "model": n or _base_name(server),
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                    for n in outs
                ]
                return list(
                    await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
                )

        for name, r in zip(outs, asyncio.run(all_at_once())):
            assert r.json()["choices"][0]["token_ids"] == outs[name], name


def test_chat_messages_and_responses_select_the_adapter_by_model(server: LaunchedServer) -> None:
    msg = [{"role": "user", "content": "Say something."}]
    texts = {}
    for model in ("qvd8", _base_name(server)):
        chat = _post(
            server,
            "/v1/chat/completions",
            {"model": model, "messages": msg, "max_tokens": 12, "temperature": 0},
        )
        messages = _post(
            server,
            "/v1/messages",
            {"model": model, "messages": msg, "max_tokens": 12, "temperature": 0},
        )
        responses = _post(
            server,
            "/v1/responses",
            {"model": model, "input": "Say something.", "max_output_tokens": 12, "temperature": 0},
        )
        assert chat.status_code == messages.status_code == responses.status_code == 200
        texts[model] = (
            chat.json()["choices"][0]["message"]["content"],
            messages.json()["content"][0]["text"],
        )
        assert texts[model][0] == texts[model][1]  # the same prompt, the same adapter
    assert len(set(texts.values())) == 2, "the adapter was ignored"
    unknown = _post(server, "/v1/messages", {"model": "nope", "messages": msg, "max_tokens": 4})
    assert unknown.status_code == 404


def test_a_prompt_under_adapter_a_then_b_shares_no_cached_block(
    server: LaunchedServer, adapters: dict[str, Path]
) -> None:
    with _loaded(server, "gu16", adapters["gu16"]):
        prompt = random_prompts(1, seed=77)[0] * 4  # 20 tokens x 4: several full blocks

        def cached(model: str) -> int:
            r = _complete(server, model, prompt, max_tokens=2)
            assert r.status_code == 200, r.text
            details = r.json()["usage"].get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0)

        assert cached("qvd8") == 0
        assert cached("gu16") == 0  # the same tokens under another adapter: nothing shared
        assert cached(_base_name(server)) == 0
        assert cached("qvd8") > 0 and cached("gu16") > 0  # each reuses its own


def test_bad_lora_input_gets_a_4xx_naming_it_and_the_server_serves_on(
    server: LaunchedServer, adapters: dict[str, Path]
) -> None:
    cases = [
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "no such adapter"),
        ({"lora_name": "x", "lora_path": str(adapters["not_lora"])}, 400, "not a LoRA"),
        ({"lora_name": "x", "lora_path": str(adapters["rank32"])}, 400, "--max-lora-rank 16"),
        ({"lora_name": "x", "lora_path": str(adapters["other_base"])}, 400, "shape"),
        ({"lora_name": "qvd8", "lora_path": str(adapters["qvd8"])}, 400, "already loaded"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]
    for body, status, words in cases:
        r = _post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == status and words in r.text, (body, r.status_code, r.text)
        _assert_serving(server)
    r = _complete(server, "no-such-adapter", [1, 2, 3])
    assert r.status_code == 404 and "no-such-adapter" in r.text
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404
    # --max-loras 2: one more fits, the next is refused.
    ok = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "g", "lora_path": str(adapters["gu16"])}
    )
    assert ok.status_code == 200
    full = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "h", "lora_path": str(adapters["all16"])}
    )
    assert full.status_code == 400 and "--max-loras" in full.text
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "g"}).status_code == 200
    _assert_serving(server)


def _worker(srv: LaunchedServer, role: str) -> dict[str, Any]:
    return next(w for w in srv.health()["workers"] if w["role"] == role)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_load_serve_unload_and_load_again_keeps_memory_bounded(
    server: LaunchedServer, adapters: dict[str, Path], default_model_path: Path
) -> None:
    prompt = [5, 6, 7, 8, 9]
    pids = [pid_of(server, "pdserve:prefill-0"), pid_of(server, "pdserve:decode-0")]
    rss: list[list[int]] = []
    for cycle in range(4):
        name = f"cycle{cycle}"
        path = adapters["all16" if cycle % 2 else "gu16"]
        assert (
            _post(
                server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
            ).status_code
            == 200
        )
        r = _complete(server, name, prompt)
        assert r.json()["choices"][0]["token_ids"] == _want(default_model_path, path, prompt)
        assert _post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
        assert _complete(server, name, prompt).status_code == 404
        rss.append([_rss_kib(p) for p in pids])
    for role in ("prefill", "decode"):
        load = _worker(server, role)["load"]
        assert load["lora_adapters"] <= 2, load  # --max-loras: the resident set's bound
    # Resident sets are bounded: later cycles hold no more than the second one did.
    for p in range(len(pids)):
        assert rss[-1][p] <= rss[1][p] + 16 * 1024, rss


def test_unload_frees_the_adapter_on_every_worker_at_once(
    server: LaunchedServer, adapters: dict[str, Path]
) -> None:
    """No request follows the unload: the workers drop the adapter on the unload alone."""
    path = adapters["all16"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "prompt", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert _complete(server, "prompt", [4, 5, 6], max_tokens=3).status_code == 200
    held = {role: _worker(server, role)["load"]["lora_adapters"] for role in ("prefill", "decode")}
    assert min(held.values()) >= 1, held  # both ran the request under it
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "prompt"}).status_code == 200
    deadline = time.monotonic() + 5
    while True:
        now = {role: _worker(server, role)["load"]["lora_adapters"] for role in held}
        if all(now[role] == held[role] - 1 for role in held):
            break
        assert time.monotonic() < deadline, (held, now)
        time.sleep(0.05)
    _assert_serving(server)


def test_a_decode_worker_killed_mid_stream_resumes_an_adapter_request_exactly(
    server: LaunchedServer, adapters: dict[str, Path], default_model_path: Path
) -> None:
    wait_all_alive(server)
    prompts = random_prompts(3, seed=31)

    async def stream(
        client: httpx.AsyncClient, prompt: list[int], started: asyncio.Event
    ) -> list[int]:
        body = {
            "model": "qvd8",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        ids: list[int] = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice.get("token_ids") or []
                    if len(ids) >= 6:
                        started.set()
        return ids

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream(client, p, started)) for p in prompts]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(pid_of(server, "pdserve:decode-0"), signal.SIGKILL)
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 100))

    results = asyncio.run(main())
    for prompt, ids in zip(prompts, results, strict=True):
        assert ids == _want(default_model_path, adapters["qvd8"], prompt)
    wait_all_alive(server)
