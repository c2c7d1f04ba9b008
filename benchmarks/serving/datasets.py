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
