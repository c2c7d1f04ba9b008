"""``n``, ``best_of``, ``echo`` and tool calling through a launched 2P/2D server, with the
official ``openai`` SDK.

The server (``agent_server``, shared with the agent-API tests) renders tools with a
Qwen2.5-style template (``--chat-template``) and reads calls with the ``hermes`` parser. The tiny model's weights are random, so a call that
parses comes from ``tool_choice`` being enforced with structured output.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.conftest import AGENT_MODEL as MODEL
from tests.e2e.helpers import WEATHER_SCHEMA, computed_prefill_tokens
from wire.params import choice_seed

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _sampled(**fields: Any) -> dict[str, Any]:
    """A request's fields for the n/best_of tests: sampled at temperature 1 (seeded by
    ``fields``) and never cut short by EOS, so every choice has its full length."""
    return dict(model=MODEL, temperature=1.0, extra_body={"ignore_eos": True}, **fields)


@pytest.fixture(scope="module")
def sdk(agent_server: LaunchedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=agent_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


# ---- n > 1 ---------------------------------------------------------------------------


def test_n_choices_are_distinct_reproducible_and_share_the_prompt(
    sdk: openai.OpenAI, agent_server: LaunchedServer
) -> None:
    prompt = "A unique prompt for the n test: " + "lorem ipsum " * 20  # 40+ tokens, uncached
    args = _sampled(prompt=prompt, max_tokens=12, seed=1234)
    before = computed_prefill_tokens(agent_server)
    first = sdk.completions.create(n=3, **args)
    prompt_len = first.usage.prompt_tokens
    # The prompt's KV was computed (and allocated) once for the three choices.
    assert computed_prefill_tokens(agent_server) - before == prompt_len
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert first.usage.completion_tokens == 3 * 12
    again = sdk.completions.create(n=3, **args)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    # Choice i samples with choice_seed(seed, i): it is that single request's output.
    for i in (0, 2):
        one = sdk.completions.create(**{**args, "seed": choice_seed(1234, i)})
        assert one.choices[0].text == texts[i]


def test_n_choices_stream_with_their_indices_and_usage(sdk: openai.OpenAI) -> None:
    args = _sampled(messages=ASK, max_tokens=10, seed=7, n=3)
    whole = sdk.chat.completions.create(**args)
    want = {c.index: c.message.content for c in whole.choices}
    got: dict[int, str] = {0: "", 1: "", 2: ""}
    roles, finishes, usage = set(), {}, None
    for chunk in sdk.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert got == want and len(set(want.values())) == 3
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 30
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_best_of_keeps_the_most_likely_choice(sdk: openai.OpenAI) -> None:
    args = _sampled(prompt="Best of three:", max_tokens=8, seed=99)
    all3 = sdk.completions.create(n=3, logprobs=0, **args)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in all3.choices}
    best = sdk.completions.create(n=1, best_of=3, **args)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(totals, key=totals.__getitem__)
    assert best.usage.completion_tokens == 3 * 8  # every candidate was generated
    with pytest.raises(openai.BadRequestError, match="best_of"):
        sdk.completions.create(n=2, best_of=1, **args)


def test_echo_prepends_the_prompt(sdk: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model=MODEL, prompt="Echo me:", max_tokens=5, temperature=0, echo=True
    )
    whole = sdk.completions.create(**args)
    plain = sdk.completions.create(**{**args, "echo": False})
    assert whole.choices[0].text == "Echo me:" + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text for c in sdk.completions.create(stream=True, **args) if c.choices
    )
    assert streamed == whole.choices[0].text
    with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
        sdk.completions.create(logprobs=1, **args)


# ---- tools ---------------------------------------------------------------------------


def _check_weather_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # type: ignore[index]
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_round_trip(sdk: openai.OpenAI, stream: bool) -> None:
    """Turn 1: the model must call a tool (required); turn 2: the result goes back in."""
    args: dict[str, Any] = dict(
        model=MODEL,
        tools=[WEATHER, TIME],
        max_tokens=120,
        seed=5,
        temperature=1.0,
        parallel_tool_calls=False,
    )
    if stream:
        call = _streamed_call(
            sdk.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **args)
        )
    else:
        r = sdk.chat.completions.create(messages=ASK, tool_choice="required", **args)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        (call,) = r.choices[0].message.tool_calls or []
    if call.function.name == "get_time":
        json.loads(call.function.arguments)
    else:
        _check_weather_call(call)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    final = sdk.chat.completions.create(
        messages=history, tool_choice="none", **{**args, "max_tokens": 8}
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str)
    assert not final.choices[0].message.tool_calls


def _streamed_call(chunks: Any) -> Any:
    """Reassemble the one call of a stream as OpenAI clients do; checks the delta shape."""
    head: Any = None
    arguments, finish, fragments = "", None, 0
    for chunk in chunks:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                if head is None:
                    assert d.id and d.type == "function" and d.function.name
                    head = d
                else:
                    assert d.id is None and d.function.name is None
                arguments += d.function.arguments or ""
                fragments += 1
    assert head is not None and finish in ("tool_calls", "stop")
    head.function.arguments = arguments
    head.fragments = fragments
    return head


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_always_yields_that_call(sdk: openai.OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        args: dict[str, Any] = dict(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=100,
            seed=seed,
        )
        if stream:
            call = _streamed_call(sdk.chat.completions.create(stream=True, **args))
            assert call.fragments > 2  # the arguments stream as they are generated
        else:
            r = sdk.chat.completions.create(**args)
            assert r.choices[0].finish_reason == "stop"  # as OpenAI finishes a named call
            (call,) = r.choices[0].message.tool_calls or []
        _check_weather_call(call)


HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
    r'"unit": "celsius"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(sdk: openai.OpenAI, stream: bool) -> None:
    """With tool_choice auto the hermes parser reads the model's ``<tool_call>`` text; a
    regex makes the random model write one."""
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        # The regex's longest match is 102 bytes and a token is at least one: a sampled
        # path of single-byte tokens still ends inside the budget.
        max_tokens=128,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    if stream:
        call = _streamed_call(sdk.chat.completions.create(stream=True, **args))
    else:
        r = sdk.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls or []
    assert _check_weather_call(call)["unit"] == "celsius"
    plain = sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None  # gibberish is content, not a call


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "a name of"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    sdk: openai.OpenAI, fields: dict[str, Any], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=needle):
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
