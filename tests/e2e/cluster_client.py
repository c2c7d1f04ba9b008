"""A client run inside a test's network namespace (``python -m tests.e2e.cluster_client``):
the head node's HTTP port is reachable only from there.

    python -m tests.e2e.cluster_client URL < prompts.json

Streams every prompt (a JSON list of token-id lists) at once, greedy; prints ``started``
once tokens flow (the test may then kill a worker), then one JSON line of results, each
as ``tests.e2e.helpers.greedy_stream`` returns it.
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


def main() -> None:
    prompts = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_main(sys.argv[1], prompts))), flush=True)


if __name__ == "__main__":
    main()
