"""Schema-driven fuzzing: bodies for every POST endpoint, generated from the server's own
``/openapi.json`` and then mutated, must never get a 5xx.

Each body is drawn from its endpoint's request schema (``from_schema``: Hypothesis
strategies for the JSON-schema subset pydantic writes, the ``examples`` a field lists
among them, the served model's name in most bodies), then
usually mutated once at a random place: a value swapped for a list, an object, null, a
number or a 100 KB string; a field dropped or an unknown one added; a value nested up to
600 levels deep, or a string replaced by JSON text nested up to 50,000; unicode text; a number at or past a bound (2**63, 1e308, -1). The
checks (``problems``): no 5xx; every 4xx in its API's error shape (Anthropic's on
``/v1/messages...``, OpenAI's elsewhere); no server error inside a 2xx stream. The
output budget of a generating body is kept small (``MAX_TOKENS``) unless a mutation
makes it invalid: the fuzz tests the front door, not the model's speed.

    python -m benchmarks.serving.api_fuzz --bodies 5000 --out benchmarks/results/api_fuzz

launches its own small server (``LAUNCH_ARGS``, the tiny model) unless ``--url`` names
one; ``tests/e2e/test_schema_fuzz.py`` runs the same fuzz, bounded, in the suite.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from hypothesis import strategies as st

ANTHROPIC_PREFIX = "/v1/messages"
MAX_TOKENS = 4
# Fields that ask for output tokens; None or absent would ask for the whole context.
BUDGETS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"}
DEFAULT_BUDGET = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/messages": "max_tokens",
    "/v1/responses": "max_output_tokens",
}
TEMPLATE = Path(__file__).resolve().parents[2] / "tests" / "e2e" / "data" / "qwen2_5_tools.jinja"
LAUNCH_ARGS = [
    *shlex.split(
        "--prefill 1 --decode 1 --detokenizers 1 --device cpu --kv-cache-tokens 4096 --max-model-len 256 --chat-template"
    ),
    str(TEMPLATE),
    "--tool-call-parser",
    "hermes",
]
HUGE = "x" * 100_000

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
any_json = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
swapped = st.one_of(
    st.lists(json_leaf, max_size=3),
    st.dictionaries(st.text(max_size=4), json_leaf, max_size=2),
    st.none(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.just(HUGE),
    st.booleans(),
)
edge_numbers = st.sampled_from(
    [0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 5e-324, 0.5, -0.0]
)
unicode_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
MUTATIONS = ("none", "swap", "drop", "extra", "deep", "unicode", "bounds")


def endpoint_schemas(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Path -> a self-contained JSON schema of its request body, from an OpenAPI doc."""
    components = doc.get("components", {}).get("schemas", {})
    defs = json.loads(json.dumps(components).replace("#/components/schemas/", "#/$defs/"))
    out = {}
    for path, ops in doc["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if body is None:
            continue
        ref = body["content"]["application/json"]["schema"]["$ref"]
        out[path] = {**defs[ref.rsplit("/", 1)[1]], "$defs": defs}
    return out


def _nodes(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every path in ``value`` (itself first)."""
    out = [path]
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in items:
        out += _nodes(child, (*path, key))
    return out


def _replace(body: Any, path: tuple[str | int, ...], new: Any) -> Any:
    if not path:
        return new
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return body


def _nest(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


@st.composite
def mutated(draw: st.DrawFn, schema: dict[str, Any], base: st.SearchStrategy[Any]) -> Any:
    """A body of ``schema``, mutated once at a random place (or not at all)."""
    body = draw(base)
    kind = draw(st.sampled_from(MUTATIONS))
    path = draw(st.sampled_from(_nodes(body)))
    here: Any = body
    for key in path:
        here = here[key]
    if kind == "swap":
        body = _replace(body, path, draw(swapped))
    elif kind == "drop" and path:
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    elif kind == "extra" and isinstance(here, dict):
        here[draw(st.text(min_size=1, max_size=8))] = draw(any_json)
    elif kind == "deep" and isinstance(here, str):  # JSON text: tool arguments, schemas
        depth = draw(st.sampled_from([70, 300, 2000, 50_000]))
        body = _replace(body, path, "[" * depth + "]" * depth)
    elif kind == "deep":  # within what a client's own encoder can write
        body = _replace(body, path, _nest(draw(st.integers(30, 600))))
    elif kind == "unicode":
        body = _replace(body, path, draw(unicode_text))
    elif kind == "bounds":
        body = _replace(body, path, draw(edge_numbers))
    return body


def bounded(path: str, body: Any) -> Any:
    """``body`` with its output budget small: present, and an int at most ``MAX_TOKENS``
    wherever it was None or larger (a mutation to another type is left: that is a 400)."""
    if not isinstance(body, dict):
        return body
    for where in (body, body.get("sampling_params")):
        if not isinstance(where, dict):
            continue
        for name in BUDGETS & set(where):
            value = where[name]
            if value is None or (
                isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS
            ):
                where[name] = MAX_TOKENS
    budget = DEFAULT_BUDGET.get(path)
    if budget is not None:
        body.setdefault(budget, MAX_TOKENS)
    if path == "/generate" and "sampling_params" not in body:
        body["sampling_params"] = {}
    sampling = body.get("sampling_params")
    if path == "/generate" and isinstance(sampling, dict):
        sampling.setdefault("max_new_tokens", MAX_TOKENS)
    return body


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of ``schema`` (the subset pydantic's schemas use; anything else: any JSON).

    Small on purpose: strings of a few characters, lists of a few items. Mutations bring
    the extremes (``mutated``)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(sub, defs) for sub in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    base = _typed(schema, defs)
    if schema.get("examples"):  # the values that reach past the first check, mostly
        return st.one_of(
            st.sampled_from(schema["examples"]), st.sampled_from(schema["examples"]), base
        )
    return base


def _typed(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        if not props and isinstance(schema.get("additionalProperties"), dict):
            values = from_schema(schema["additionalProperties"], defs)
            return st.dictionaries(st.text(max_size=6), values, max_size=3)
        if not props:
            return st.dictionaries(st.text(max_size=6), any_json, max_size=3)
        fields = {k: from_schema(v, defs) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    simple: dict[str, st.SearchStrategy[Any]] = {
        "string": st.text(max_size=12),
        "integer": st.integers(-2, 40),
        "number": st.floats(-2, 2) | st.integers(0, 2),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), max_size=3)
    return simple.get(str(kind), any_json)


def strategies(
    schemas: dict[str, dict[str, Any]], model: str | None = None
) -> dict[str, st.SearchStrategy[Any]]:
    """Path -> its strategy of hostile bodies (already ``bounded``), naming ``model``
    (the served one) in 7 of 8 bodies that name one."""
    out = {}
    for path, schema in schemas.items():
        base = from_schema(schema, schema.get("$defs", {}))
        if model is not None:
            base = st.tuples(base, st.sampled_from([True] * 7 + [False])).map(
                lambda pair: _named(pair[0], model) if pair[1] else pair[0]
            )
        out[path] = mutated(schema, base).map(partial(bounded, path))
    return out


def _named(body: Any, model: str) -> Any:
    if isinstance(body, dict) and "model" in body:
        body["model"] = model
    return body


def error_shape_problem(path: str, status: int, payload: Any) -> str | None:
    """What is wrong with a 4xx body for ``path``'s API, or None."""
    if path.startswith(ANTHROPIC_PREFIX):
        ok = (
            isinstance(payload, dict)
            and payload.get("type") == "error"
            and isinstance(payload.get("error"), dict)
            and isinstance(payload["error"].get("type"), str)
            and isinstance(payload["error"].get("message"), str)
        )
    else:
        err = payload.get("error") if isinstance(payload, dict) else None
        ok = (
            isinstance(err, dict)
            and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str)
            and "param" in err
            and "code" in err
        )
    return None if ok else f"{status} not in the API's error shape: {str(payload)[:200]}"


def stream_problem(text: str) -> str | None:
    """A server error inside a 2xx event stream, or None."""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return f"an event that is not JSON: {line[:120]}"
        err = event.get("error") if isinstance(event, dict) else None
        kind = err.get("type") if isinstance(err, dict) else None
        if kind in ("server_error", "api_error") or (
            isinstance(event, dict) and event.get("type") == "response.failed"
        ):
            return f"a server error in the stream: {line[:200]}"
    return None


def problems(path: str, response: httpx.Response) -> list[str]:
    """Everything wrong with ``response`` to a fuzzed body."""
    if response.status_code >= 500:
        return [f"{response.status_code}: {response.text[:300]}"]
    if response.status_code >= 400:
        try:
            payload = response.json()
        except ValueError:
            return [f"{response.status_code} with a body that is not JSON"]
        problem = error_shape_problem(path, response.status_code, payload)
        return [problem] if problem else []
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        problem = stream_problem(response.text)
        return [problem] if problem else []
    return []


def send(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return client.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )


@dataclass
class Tally:
    """What a fuzz run sent and found."""

    bodies: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    found: list[str] = field(default_factory=list)

    def record(self, path: str, response: httpx.Response) -> list[str]:
        self.bodies += 1
        self.statuses[f"{path} {response.status_code}"] += 1
        found = problems(path, response)
        self.found += [f"{path}: {p}" for p in found]
        return found


def run(url: str, bodies: int, seed: int, on_body: Callable[[int], None] | None = None) -> Tally:
    """Send ``bodies`` fuzzed bodies, round robin over the endpoints."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as seeded

    with httpx.Client(base_url=url, timeout=120) as client:
        schemas = endpoint_schemas(client.get("/openapi.json").json())
        model = client.get("/v1/models").json()["data"][0]["id"]
        tally = Tally()
        per_path = max(1, bodies // len(schemas))
        for path, strategy in strategies(schemas, model).items():
            rng = random.Random(f"{seed}:{path}")
            fuzz = given(strategy)(_sender(client, path, tally, on_body))
            fuzz = settings(
                max_examples=per_path,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )(fuzz)
            seeded(rng.getrandbits(64))(fuzz)()
    return tally


def _sender(
    client: httpx.Client, path: str, tally: Tally, on_body: Callable[[int], None] | None
) -> Callable[[Any], None]:
    def send_one(body: Any) -> None:
        tally.record(path, send(client, path, body))
        if on_body is not None:
            on_body(tally.bodies)

    return send_one


def report(tally: Tally, command: str, seconds: float, same_after: bool) -> str:
    from benchmarks.harness.machine import portable, report_head

    lines = report_head("Schema-driven API fuzz", portable(command))
    lines += [
        f"{tally.bodies} bodies in {seconds:.0f} s, over every POST endpoint of "
        "`/openapi.json`; each generated from its endpoint's request schema, then "
        "mutated (see `benchmarks/serving/api_fuzz.py`).",
        "",
        f"Found: **{len(tally.found)} problems** (5xx, a 4xx out of its API's error "
        "shape, a server error inside a stream).",
        "",
        f"A greedy request answered the same before and after: **{same_after}**.",
        "",
        "| endpoint and status | bodies |",
        "| --- | --- |",
    ]
    lines += [f"| `{k}` | {v} |" for k, v in sorted(tally.statuses.items())]
    if tally.found:
        lines += ["", "Problems:", ""] + [f"- {p}" for p in tally.found[:50]]
    return "\n".join(lines) + "\n"


PROBE = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}


def probe(url: str) -> str:
    """A normal greedy chat answer: the same before and after a fuzz run."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", json={**PROBE, "model": model}, timeout=60)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def _progress(bodies: int) -> None:
    if bodies % 500 == 0:
        print(f"{bodies} bodies", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bodies", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="fuzz this server instead of launching one")
    p.add_argument("--out", type=Path, help="write <out>.md")
    args = p.parse_args(argv)
    proc = None
    if args.url is None:
        from benchmarks.harness.servers import launch

        proc, args.url = launch(LAUNCH_ARGS)
    try:
        before, t0 = probe(args.url), time.monotonic()
        tally = run(args.url, args.bodies, args.seed, _progress)
        seconds, same = time.monotonic() - t0, probe(args.url) == before
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    text = report(
        tally,
        "python -m benchmarks.serving.api_fuzz " + " ".join(argv or sys.argv[1:]),
        seconds,
        same,
    )
    print(text)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(text)
    return 0 if same and not tally.found else 1


if __name__ == "__main__":
    raise SystemExit(main())
