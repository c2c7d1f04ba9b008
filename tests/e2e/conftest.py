"""Fixtures of several e2e modules: the server the agent-API tests share
(``test_messages_api.py``, ``test_responses_api.py``: 2 prefill, 2 decode, 2 detokenizer
processes on CPU, the tiny model with a tool-aware (Qwen2.5-style) chat template and the
hermes tool-call parser), the fuzz tests' client with the worker pids it starts from, and
the ``victim`` server the fault tests kill workers of."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import Exact, reported_pids

TOOLS_TEMPLATE = Path(__file__).parent / "data" / "qwen2_5_tools.jinja"
AGENT_MODEL = "tiny"


@pytest.fixture(scope="session")
def agent_server() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        [
            *shlex.split(
                "--prefill 2 --decode 2 --detokenizers 2 --device cpu --kv-cache-tokens 16384 --max-model-len 1024 --served-model-name"
            ),
            AGENT_MODEL,
            "--chat-template",
            str(TOOLS_TEMPLATE),
            "--tool-call-parser",
            "hermes",
        ]
    )


@pytest.fixture(scope="module")
def victim() -> Iterator[LaunchedServer]:
    """A 2P/2D server of its own per module, for tests that kill or stop its workers: a
    short stall timeout, so a stopped worker is given up on within seconds."""
    yield from LaunchedServer.serving(
        "--prefill 2 --decode 2 --detokenizers 2 --device cpu --kv-cache-tokens 8192 --max-model-len 1024 --stall-timeout 4 --served-model-name tiny"
    )


@pytest.fixture(scope="module")
def worker_pids(server: LaunchedServer) -> dict[tuple[str, int], int]:
    """Every worker's pid before the first fuzzed request (the fuzz tests check no worker
    was replaced since)."""
    return reported_pids(server)


@pytest.fixture(scope="module")
def http(server: LaunchedServer, worker_pids: dict[tuple[str, int], int]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def exact(default_model_path: Path, qwen_tokenizer: Any) -> Exact:
    """Checks that streams are the whole greedy continuations of their prompts."""
    return Exact(default_model_path, qwen_tokenizer)
