"""Token counts as the OpenAI APIs report them."""

from __future__ import annotations

from typing import Any


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
    predictions: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` once it is known,
    ``completion_tokens_details.reasoning_tokens`` with a reasoning parser, and its
    ``accepted_prediction_tokens``/``rejected_prediction_tokens`` from ``predictions``
    (accepted, rejected) when the request asked for them (``EngineCall.predictions``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    details: dict[str, int] = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if predictions is not None:
        details["accepted_prediction_tokens"] = predictions[0]
        details["rejected_prediction_tokens"] = predictions[1]
    if details:
        out["completion_tokens_details"] = details
    return out
