"""Why the engine failed a request, as its ERROR row carries it, and what the client is
told of it. An ERROR row carries no token (``wire.records.TokenBatch``), so its token id
is free to name the cause."""

from __future__ import annotations

import enum


class ErrorCause(enum.IntEnum):
    """Why the engine failed a request: the token id of its ERROR row (a row that
    carries no token, so its id is free to say why)."""

    ENGINE = -1  # a grammar that did not compile, a request that can never fit, ...
    NO_ALLOWED_TOKEN = -2  # the output grammar allowed no next token


def error_message(token_id: int) -> str:
    """What a client is told of an ERROR row whose token id is ``token_id``."""
    if token_id == ErrorCause.NO_ALLOWED_TOKEN:
        return "the output constraint allowed no next token, so the request was ended"
    return "the engine failed this request"
