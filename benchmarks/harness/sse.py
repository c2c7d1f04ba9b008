"""Reading the server-sent event streams the OpenAI-style endpoints answer with."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def sse_chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON chunk of every ``data:`` line of a stream, without the closing ``[DONE]``."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
