"""The frontend's configuration: one frozen record, built by the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class FrontendSettings:
    """What the HTTP layer needs to know about the model and its own limits.

    ``vocab_size`` is the model's (possibly padded) embedding size: token ids in prompts
    and ``stop_token_ids`` must lie below it. ``chat_template`` overrides the tokenizer's.
    ``eos_token_ids`` are the model's (its grammars end on them, as in the workers).
    ``tool_call_parser`` reads tool calls out of chat output (frontend/tool_parsers.py);
    None: ``tool_choice: auto`` is refused.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_logprobs: int = 20
    host: str = "127.0.0.1"
    port: int = 8000
    eos_token_ids: tuple[int, ...] = ()
    tool_call_parser: str | None = None
