"""Schema-driven fuzzing of a launched server (issue 36): every POST endpoint's bodies are
generated from the request schema the server itself publishes in /openapi.json, then
mutated (``benchmarks/serving/api_fuzz.py``: types swapped for lists, objects, null, numbers and
huge strings, fields dropped and added, deep nesting, unicode, numbers at their bounds).

No body may get a 5xx; every 4xx must be in its API's own error shape; no stream may
carry a server error; afterwards every worker is the same process and a greedy request
is answered as before. Bounded: ``EXAMPLES`` bodies per endpoint with a 4-token output
budget, a few seconds per endpoint on the tiny model. The long run is
``python -m benchmarks.serving.api_fuzz`` (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from benchmarks.serving.api_fuzz import endpoint_schemas, probe, problems, send, strategies
from frontend.http.routes import BARE_ROUTES, ROUTES
from tests.conftest import LaunchedServer
from tests.e2e.helpers import reported_pids

EXAMPLES = 20
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


class Fuzz:
    """The server under fuzz, its schemas and what it answered before."""

    def __init__(self, server: LaunchedServer) -> None:
        self.server = server
        self.client = httpx.Client(base_url=server.url, timeout=60)
        self.doc = self.client.get("/openapi.json").json()
        model = self.client.get("/v1/models").json()["data"][0]["id"]
        self.strategies = strategies(endpoint_schemas(self.doc), model)
        self.pids = reported_pids(server)
        self.answer = probe(server.url)


@pytest.fixture(scope="module")
def fuzz(agent_server: LaunchedServer) -> Iterator[Fuzz]:
    f = Fuzz(agent_server)
    yield f
    f.client.close()


def test_openapi_doc_has_every_endpoints_request_schema(fuzz: Fuzz) -> None:
    posts = {p for p, ops in fuzz.doc["paths"].items() if "post" in ops}
    bare = {path for method, path in BARE_ROUTES if method == "POST"}
    assert posts == {*ROUTES, *bare}  # the reset and roles routes have no body model to fuzz
    assert set(fuzz.strategies) == set(ROUTES)
    messages = fuzz.doc["components"]["schemas"]["MessagesRequest"]
    assert {"model", "messages", "max_tokens"} <= set(messages["required"])


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_no_fuzzed_body_gets_a_5xx_or_a_misshapen_4xx(fuzz: Fuzz, path: str) -> None:
    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        body: Any = data.draw(fuzz.strategies[path], label="body")
        response = send(fuzz.client, path, body)
        event(f"HTTP {response.status_code}")
        assert problems(path, response) == []

    run()


def test_the_server_is_unchanged_after_the_fuzzing(fuzz: Fuzz) -> None:
    assert reported_pids(fuzz.server) == fuzz.pids
    assert probe(fuzz.server.url) == fuzz.answer
