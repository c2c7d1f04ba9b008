"""The server the agent-API tests share (``test_messages_api.py``, ``test_responses_api.py``):
2 prefill, 2 decode, 2 detokenizer processes on CPU, the tiny model with a tool-aware
(Qwen2.5-style) chat template and the hermes tool-call parser."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LaunchedServer

TOOLS_TEMPLATE = Path(__file__).parent / "data" / "qwen2_5_tools.jinja"
AGENT_MODEL = "tiny"


@pytest.fixture(scope="session")
def agent_server() -> Iterator[LaunchedServer]:
    s = LaunchedServer(
        ["--prefill", "2", "--decode", "2", "--detokenizers", "2", "--device", "cpu",
         "--kv-cache-tokens", "16384", "--max-model-len", "1024",
         "--served-model-name", AGENT_MODEL, "--chat-template", str(TOOLS_TEMPLATE),
         "--tool-call-parser", "hermes"]
    )  # fmt: skip
    s.wait_ready()
    yield s
    s.stop()
