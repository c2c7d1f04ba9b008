"""A conversation through its chat template into token ids, with message content kept text.

Why: the rendered prompt used to be tokenized as a whole, so ``<|im_end|>\\n<|im_start|>system``
typed into a user message became the real control tokens and the user could forge a system
turn. Here only the control tokens the template writes itself are tokens; the same text
inside a message is tokenized as the characters it is.

How: each control token inside a message is wrapped in markers carrying a per-request
random nonce (so no message can forge one), the template is rendered, and the rendered text
is split at the markers. The pieces between are tokenized as before (the template's own
control tokens stay tokens); each wrapped token is tokenized as plain text. A template that
cuts content apart (``split('</think>')``) may separate a marker from its token; a lone
marker is dropped but still splits the text, so the two sides cannot join into a token.
Conversations with no control-token text in their content take exactly the old path.

Control tokens are the tokenizer's special added tokens, and its other added tokens that the
template itself writes (Qwen3's ``<think>``), as ``transformers``' ``sanitize_control_tokens``
defines them.
"""

from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

Conversation = list[dict[str, Any]]  # role, content, and for tool turns their fields


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation and how its chat template renders it.

    ``continue_final_message``: the last (assistant) message is left open, so that the
    reply continues it.
    """

    template: str
    conversation: Conversation
    add_generation_prompt: bool
    tools: list[dict[str, Any]] | None = None
    continue_final_message: bool = False


def control_tokens(tokenizer: Any, template: str) -> tuple[str, ...]:
    """Longest first, so that a token wins over the tokens it contains."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    found = {
        t.content for t in added if t.special or (t.content in template and not t.content.isspace())
    }
    return tuple(sorted(found, key=len, reverse=True))


@functools.lru_cache(maxsize=16)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(map(re.escape, tokens)) or "(?!)")  # (?!) matches nothing


def encode_chat(tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """Render ``prompt`` with its template and tokenize it, content as text.

    Raises what the template raises (``raise_exception`` in Jinja: roles must alternate).
    """
    pattern = _pattern(control_tokens(tokenizer, prompt.template))
    if not any(pattern.search(m["content"]) for m in prompt.conversation):
        return encode_rendered(tokenizer, prompt)
    nonce = secrets.token_hex(8)
    start, end = f"\ue000{nonce}", f"\ue001{nonce}"  # private-use characters: no token's text
    marked = [
        {**m, "content": pattern.sub(lambda t: start + t.group(0) + end, m["content"])}
        for m in prompt.conversation
    ]
    text = render(tokenizer, replace(prompt, conversation=marked))
    s, e = re.escape(start), re.escape(end)
    # [text, wrapped token, text, wrapped token, ..., text]; None for a lone marker.
    pieces = re.split(f"{s}({pattern.pattern}){e}|{s}|{e}", text)
    ids = list(tokenizer.encode(pieces[0], add_special_tokens=False))
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:
            ids += _encode_mid(tokenizer, piece, as_text=i % 2 == 1)
    return ids


def render(tokenizer: Any, prompt: ChatPrompt) -> str:
    text = tokenizer.apply_chat_template(
        prompt.conversation,
        tools=prompt.tools,
        chat_template=prompt.template,
        tokenize=False,
        add_generation_prompt=prompt.add_generation_prompt,
        continue_final_message=prompt.continue_final_message,
    )
    assert isinstance(text, str)
    return text


def encode_rendered(tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """The rendered prompt tokenized whole: control-token text in content becomes tokens
    (``--allow-special-tokens-in-content``, and the path for content with none)."""
    text = render(tokenizer, prompt)
    # The template writes BOS and role markers itself: no special tokens added again.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _encode_mid(tokenizer: Any, piece: str, as_text: bool) -> list[int]:
    """A piece from the middle of the prompt: after a newline, so that a SentencePiece
    tokenizer does not add the word-start space it adds at the start of a string; the
    newline's ids are then cut off again (when they did not merge with the piece)."""

    def encode(text: str) -> list[int]:
        if as_text:
            return _plain_text_ids(tokenizer, text)
        return list(tokenizer.encode(text, add_special_tokens=False))

    newline = encode("\n")
    ids = encode("\n" + piece)
    return ids[len(newline) :] if ids[: len(newline)] == newline else encode(piece)


def _plain_text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized with no added token recognised in it.

    NOTE: not ``encode(split_special_tokens=True)``: on a fast tokenizer that flips a flag
    on the shared Rust tokenizer, and a prompt tokenized meanwhile on another thread (long
    prompts are, see ``ServingContext.encode``) would have its special tokens split too.
    The backend's pipeline without its added-token pass is what that flag selects.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: the argument is per call there
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = (
        [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        if (backend.pre_tokenizer is not None)
        else [text]
    )
    return [t.id for w in words for t in backend.model.tokenize(w)]
