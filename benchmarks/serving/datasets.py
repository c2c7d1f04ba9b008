"""Benchmark request sets: random token prompts, ShareGPT conversations, and ``mixed``.

Every dataset yields ``SampleRequest``s with the prompt text, its length in the
benchmark tokenizer's tokens, and the number of output tokens to ask for.

* ``random``: prompts decoded from uniformly random vocabulary ids (special tokens
  excluded), re-encoded to hit the drawn length; lengths drawn uniformly from
  ``[len * (1 - ratio), len * (1 + ratio)]``. Sent with ``ignore_eos`` so output lengths
  are exact on servers that accept it.
* ``sharegpt``: first human turn as prompt, the reply's token count as output length;
  pairs with prompt or reply under 4 tokens, prompt over 1024 or total over 2048 are
  skipped (the filter ``vllm bench`` uses).
* ``mixed``: long prompts with short outputs interleaved with short prompts and long
  outputs (prefill-heavy and decode-heavy requests alternating): even requests get
  ``(input_len, output_len // 8)``, odd ones ``(input_len // 8, output_len)``.
* ``multiturn``: chat conversations of ``turns`` turns that share one system prompt of
  ``prefix_len`` tokens; each turn's prompt is the history (system prompt, earlier
  messages and the dataset's own replies of ``output_len`` tokens) plus a new message of
  ``input_len`` tokens, and is sent only once the conversation's previous turn ended
  (``SampleRequest.after``). Requests are ordered turn by turn across conversations.
* ``shared-prefix``: one long prefix of ``prefix_len`` tokens followed by short distinct
  suffixes of ``input_len`` tokens (a shared document or few-shot prompt).
Both prefix datasets are random-token text, as ``random`` is.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int
    # Chat messages as (role, content), sent as such to the chat endpoint; ``prompt``
    # is their plain-text rendering for the completions endpoint.
    messages: tuple[tuple[str, str], ...] | None = None
    after: int | None = None  # index of the request that must end before this one starts


def _normal_vocab(tokenizer: Any) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set(getattr(tokenizer, "get_added_vocab", dict)().values())
    ids = [i for i in range(len(tokenizer)) if i not in special and i not in added]
    return np.asarray(ids, dtype=np.int64)


def random_prompt(tokenizer: Any, vocab: np.ndarray, length: int, rng: np.random.Generator) -> str:
    """Text that encodes to exactly ``length`` tokens (up to a few re-encoding rounds)."""
    ids = rng.choice(vocab, size=length).tolist()
    text = tokenizer.decode(ids)
    for _ in range(4):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        # Merges across the decoded boundaries change the count: trim or pad, retry.
        ids = ids[:length] + rng.choice(vocab, size=max(0, length - len(ids))).tolist()
        text = tokenizer.decode(ids)
    return str(text)


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    if not 0 <= ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def random_dataset(
    tokenizer: Any, n: int, input_len: int, output_len: int, ratio: float, seed: int
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    vocab = _normal_vocab(tokenizer)
    ins, outs = _lengths(input_len, ratio, n, rng), _lengths(output_len, ratio, n, rng)
    out = []
    for i_len, o_len in zip(ins.tolist(), outs.tolist()):
        prompt = random_prompt(tokenizer, vocab, i_len, rng)
        out.append(
            SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), o_len)
        )
    return out


def mixed_dataset(
    tokenizer: Any, n: int, input_len: int, output_len: int, seed: int
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    vocab = _normal_vocab(tokenizer)
    shapes = [(input_len, max(1, output_len // 8)), (max(4, input_len // 8), output_len)]
    out = []
    for i in range(n):
        i_len, o_len = shapes[i % 2]
        prompt = random_prompt(tokenizer, vocab, i_len, rng)
        out.append(
            SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), o_len)
        )
    return out


def sharegpt_dataset(
    tokenizer: Any, path: Path, n: int, seed: int, output_len: int | None = None
) -> list[SampleRequest]:
    data = json.loads(Path(path).read_text())
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == n:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        o_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if len(out) < n:
        raise ValueError(f"{path} has only {len(out)} usable conversations, {n} requested")
    return out


def _render(messages: list[tuple[str, str]]) -> str:
    """Plain-text rendering for the completions endpoint; each turn extends the previous."""
    return "".join(f"{role}: {content}\n\n" for role, content in messages)


def multiturn_dataset(
    tokenizer: Any,
    n: int,
    turns: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int,
) -> list[SampleRequest]:
    """``n // turns`` conversations of ``turns`` turns (see the module docstring)."""
    if turns < 1 or n < turns:
        raise ValueError(f"--num-prompts {n} must hold at least one conversation of {turns}")
    rng = np.random.default_rng(seed)
    vocab = _normal_vocab(tokenizer)
    system = random_prompt(tokenizer, vocab, prefix_len, rng)
    histories: list[list[tuple[str, str]]] = [[("system", system)] for _ in range(n // turns)]
    out: list[SampleRequest] = []
    for turn in range(turns):
        for history in histories:
            history.append(("user", random_prompt(tokenizer, vocab, input_len, rng)))
            text = _render(history)
            after = len(out) - len(histories) if turn else None  # this conversation's last
            out.append(
                SampleRequest(
                    text,
                    len(tokenizer.encode(text, add_special_tokens=False)),
                    output_len,
                    tuple(history),
                    after,
                )
            )
            history.append(("assistant", random_prompt(tokenizer, vocab, output_len, rng)))
    return out


def shared_prefix_dataset(
    tokenizer: Any, n: int, prefix_len: int, input_len: int, output_len: int, seed: int
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    vocab = _normal_vocab(tokenizer)
    prefix = random_prompt(tokenizer, vocab, prefix_len, rng) + "\n\n"
    out = []
    for _ in range(n):
        prompt = prefix + random_prompt(tokenizer, vocab, input_len, rng)
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(SampleRequest(prompt, p_len, output_len))
    return out
