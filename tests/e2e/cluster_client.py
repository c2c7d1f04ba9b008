"""A client run inside a test's network namespace (``python -m tests.e2e.cluster_client``):
the head node's HTTP port is reachable only from there.

    python -m tests.e2e.cluster_client URL < prompts.json
    python -m tests.e2e.cluster_client URL chat MODEL MAX_TOKENS < conversations.json
    python -m tests.e2e.cluster_client URL get PATH

Streams every prompt (a JSON list of token-id lists) at once, greedy; prints ``started``
once tokens flow (the test may then kill a worker), then one JSON line of results, each
as ``tests.e2e.helpers.greedy_stream`` returns it. ``chat``: one greedy chat completion
per conversation, in turn; one JSON line of their token ids. ``get``: the body of
``GET PATH`` (/health, /metrics) as it came, after a first line with its status.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx

from tests.e2e.helpers import greedy_stream


async def _main(url: str, prompts: list[list[int]]) -> list[dict]:  # type: ignore[type-arg]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = asyncio.Event()
        tasks = [asyncio.create_task(greedy_stream(client, p, started)) for p in prompts]
        await asyncio.wait_for(started.wait(), 120)
        print("started", flush=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), 150)


def _chat(url: str, model: str, max_tokens: int, conversations: list[list[dict]]) -> list:  # type: ignore[type-arg]
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for messages in conversations:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            }
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append(r.json()["choices"][0]["token_ids"])
    return out


def main() -> None:
    if sys.argv[2:3] == ["get"]:
        r = httpx.get(sys.argv[1] + sys.argv[3], timeout=30)
        print(r.status_code, r.text, sep="\n", flush=True)
        return
    given = json.loads(sys.stdin.read())
    if sys.argv[2:3] == ["chat"]:
        answer = _chat(sys.argv[1], sys.argv[3], int(sys.argv[4]), given)
    else:
        answer = asyncio.run(_main(sys.argv[1], given))
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
