"""The choices of one request (``n``, ``best_of``): one engine request each, one response.

Each choice is its own sequence with its own rid and its own seed stream (choice ``i`` of
a request seeded ``s`` samples with ``choice_seed(s, i)``, so every choice is reproducible
and choice 0 is what ``n=1`` gives). They share the prompt's KV: the first is submitted
with ``forks = k - 1`` and the others as its forks (wire/records.py GenerateRequest), all
to one prefill worker, which computes the prompt once.

``best_of`` runs ``best_of`` choices and keeps the ``n`` with the highest cumulative
logprob (the engine is asked for the sampled tokens' logprobs to rank them; they are
returned only if the client asked for logprobs).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from msgspec.structs import replace
from starlette.requests import Request

from frontend.api.common.call import EngineCall, Generation, start_all
from frontend.api.common.context import ServingContext
from frontend.engine_link.engine_client import EngineRequest
from frontend.errors import InvalidRequest
from wire.params import DetokParams, SamplingParams, choice_seed
from wire.records import TextDelta

MAX_CHOICES = 16  # n and best_of: each choice is a sequence in the engine


def check_choices(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int]:
    """(n, choices to run) from the request's ``n`` and ``best_of``; 400 if inconsistent."""
    n = 1 if n is None else n
    runs = n if best_of is None else best_of
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}]", param="n")
    if not n <= runs <= MAX_CHOICES:
        raise InvalidRequest(f"best_of must be in [n, {MAX_CHOICES}]", param="best_of")
    if runs > n and stream:
        raise InvalidRequest("best_of > n cannot be streamed", param="best_of")
    return n, runs


async def start_choices(
    ctx: ServingContext,
    request: Request,
    prompt_ids: list[int],
    sampling: SamplingParams,
    detok: DetokParams,
    runs: int,
    arrival: float,
) -> list[EngineCall]:
    """Submit ``runs`` choices (the first, then its forks) and wait for each first delta."""
    rids = [ctx.next_rid() for _ in range(runs)]
    calls = []
    for i, rid in enumerate(rids):
        params = sampling
        if sampling.seed is not None and i:
            params = replace(sampling, seed=choice_seed(sampling.seed, i))
        req = EngineRequest(
            rid=rid,
            prompt_ids=prompt_ids,
            sampling=params,
            detok=detok,
            forks=runs - 1 if i == 0 else 0,
            fork_of=rids[0] if i else -1,
        )
        calls.append(EngineCall(ctx, req, arrival))
    await start_all(calls, request)
    return calls


def best(gens: list[Generation], n: int) -> list[Generation]:
    """The ``n`` generations with the highest cumulative logprob, best first."""
    if len(gens) == n:
        return gens
    ranked = sorted(gens, key=lambda g: sum(lp.logprob for lp in g.logprobs), reverse=True)
    return ranked[:n]


async def merged(calls: list[EngineCall]) -> AsyncIterator[tuple[int, TextDelta]]:
    """(choice index, delta) of every call as they arrive; every call is aborted if the
    consumer stops early (client gone) or a call fails."""
    if len(calls) == 1:  # the common case, without a task per delta
        only = calls[0].deltas()
        try:
            async for d in only:
                yield 0, d
        finally:
            await only.aclose()  # type: ignore[attr-defined]  # aborts it if unfinished
        return
    iters = [c.deltas() for c in calls]
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                try:
                    delta = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, delta
                pending[asyncio.ensure_future(anext(iters[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()
        # A generator still runs until its cancelled step has unwound; then it closes.
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iters:
            await it.aclose()  # type: ignore[attr-defined]
