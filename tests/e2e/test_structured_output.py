"""Structured output through a launched 2P/2D server, with the official ``openai`` SDK.

The tiny model has random weights: its unconstrained text is gibberish, so every output
that validates here is the grammar's doing, on the first token (sampled by a prefill
worker) and on every decode step (after the P->D handoff rebuilt the matcher), and
through a decode worker's death (the resumed request replays its tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import jsonschema
import openai
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import pid_of

# Bounded so that every schema ends well within MAX_TOKENS, whatever the model picks.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
            "weight": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["colour", "tags", "ok", "weight"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": -50, "maximum": 50},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "maxLength": 8},
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "kind": {"enum": ["a", "b"]},
            },
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2}-[0-9]{3}"
CHOICES = ["apple", "banana split", "cherry"]
MAX_TOKENS = 256
CHAT = [{"role": "user", "content": "Answer in the requested format."}]
T = TypeVar("T")


def _run(victim: LaunchedServer, work: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> T:
    """``work(sdk)`` on a fresh event loop with a client of its own."""

    async def main() -> T:
        async with openai.AsyncOpenAI(
            base_url=victim.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as sdk:
            return await work(sdk)

    return asyncio.run(main())


def _schema_format(i: int) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True},
    }


async def _chat(sdk: openai.AsyncOpenAI, seed: int, stream: bool, **kw: Any) -> tuple[str, str]:
    """(text, finish_reason) of one sampled chat completion."""
    args: dict[str, Any] = dict(
        model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, **kw
    )
    if not stream:
        r = await sdk.chat.completions.create(**args)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", ""
    async for chunk in await sdk.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def test_twenty_json_schema_requests_all_validate(victim: LaunchedServer) -> None:
    async def one(sdk: openai.AsyncOpenAI, i: int) -> None:
        k = i % len(SCHEMAS)
        text, finish = await _chat(
            sdk, seed=i, stream=i % 2 == 1, response_format=_schema_format(k)
        )
        assert finish == "stop", (k, text)
        jsonschema.validate(json.loads(text), SCHEMAS[k])

    async def main(sdk: openai.AsyncOpenAI) -> None:
        await asyncio.gather(*(one(sdk, i) for i in range(20)))

    _run(victim, main)


@pytest.mark.parametrize(
    "extra",
    [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}],
    ids=["structured_outputs", "guided"],
)
def test_regex_requests_match(victim: LaunchedServer, extra: dict[str, Any]) -> None:
    async def main(sdk: openai.AsyncOpenAI) -> list[tuple[str, str]]:
        return await asyncio.gather(
            *(_chat(sdk, seed=i, stream=i % 2 == 0, extra_body=extra) for i in range(6))
        )

    for text, finish in _run(victim, main):
        assert finish == "stop" and re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    "extra",
    [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}],
    ids=["structured_outputs", "guided"],
)
def test_choice_requests_pick_one(victim: LaunchedServer, extra: dict[str, Any]) -> None:
    async def main(sdk: openai.AsyncOpenAI) -> list[str]:
        prompts = [f"pick {i}" for i in range(6)]
        outs = await asyncio.gather(
            *(
                sdk.completions.create(
                    model="tiny", prompt=p, max_tokens=16, temperature=1.0, seed=i, extra_body=extra
                )
                for i, p in enumerate(prompts)
            )
        )
        return [o.choices[0].text for o in outs]

    texts = _run(victim, main)
    assert all(t in CHOICES for t in texts), texts


def test_a_schema_given_as_text(victim: LaunchedServer) -> None:
    schema_text = json.dumps(SCHEMAS[0])
    text, finish = _run(
        victim,
        lambda sdk: _chat(sdk, seed=3, stream=False, extra_body={"guided_json": schema_text}),
    )
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[0])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "frobnicate"}},
                }
            },
            'Unsupported type "frobnicate"',
        ),
        ({"guided_regex": "(unclosed"}, "parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, 'Rule "missing" is not defined'),
        ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "'not'"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_choice": []}, "list of 1 to"),
    ],
)
def test_bad_constraints_are_400s_that_say_what_is_wrong(
    victim: LaunchedServer, body: dict[str, Any], needle: str
) -> None:
    response_format = body.pop("response_format", openai.NOT_GIVEN)
    with pytest.raises(openai.BadRequestError) as info:
        _run(
            victim,
            lambda sdk: sdk.chat.completions.create(
                model="tiny",
                messages=CHAT,
                max_tokens=8,
                response_format=response_format,
                extra_body=body,
            ),
        )
    assert needle in info.value.message


def test_constraints_survive_a_decode_worker_death_mid_stream(victim: LaunchedServer) -> None:
    """SIGKILL decode-0 while constrained streams run: they resume elsewhere and the
    matcher replays the tokens already streamed, so every output still validates."""

    async def stream(
        sdk: openai.AsyncOpenAI, i: int, started: asyncio.Event
    ) -> tuple[int, str, str]:
        k = i % len(SCHEMAS)
        text, finish = "", ""
        chunks = await sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=100 + i,
            response_format=_schema_format(k),
            stream=True,
        )
        async for chunk in chunks:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
                if len(text) >= 4:
                    started.set()
        return k, text, finish

    async def main(sdk: openai.AsyncOpenAI) -> list[tuple[int, str, str]]:
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream(sdk, i, started)) for i in range(12)]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(pid_of(victim, "pdserve:decode-0"), signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 100)

    results = _run(victim, main)
    assert any("resumed" in line for line in victim.log), "no stream was on decode-0"
    # What recovery and the workers said, for a stream that did not finish: the rids it
    # went through and why it ended.
    said = [line for line in victim.log if "rid" in line or "ERROR" in line]
    for k, text, finish in results:
        assert finish == "stop", (text, said[-40:])
        jsonschema.validate(json.loads(text), SCHEMAS[k])
