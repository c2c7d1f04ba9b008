"""Oracles and drivers shared by the detokenizer tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from detokenizer.shard import DetokShard
from wire.params import DetokParams
from wire.records import DetokRegister, Finish, TextBatch, TokenBatch

QWEN_IDS = 151646  # ids the Qwen2 tokenizer knows
PADDED_VOCAB = 151936  # ids a Qwen2 model can sample (the tail decodes to nothing)
SPECIAL_IDS = (151643, 151644, 151645)

# Whole vocabulary, with the edges drawn often: single bytes (stray continuation bytes,
# lone lead bytes), special tokens, and ids past the tokenizer's vocabulary.
token_ids = st.one_of(
    st.integers(0, 255),
    st.sampled_from(SPECIAL_IDS),
    st.integers(QWEN_IDS, PADDED_VOCAB - 1),
    st.integers(0, QWEN_IDS - 1),
)
id_lists = st.lists(token_ids, min_size=1, max_size=40)

_ALPHABETS = "abc xyz,.!\n" + "中文字符漢語日本語" + "😀🚀👍🏽🇫🇷" + "éàü" + "<|im_end|>"
mixed_text = st.text(alphabet=st.sampled_from(list(_ALPHABETS)), min_size=1, max_size=60)


def oracle(tokenizer: Any, ids: list[int], skip: bool, spaces: bool = True) -> str:
    return str(
        tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    )


def stop_oracle(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """Expected output and matched stop: the first stop completed reading left to right."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop) if stop else -1
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is None:
        return text, None
    return text[: best[0] if include else best[1]], best[2]


def register(rid: int, params: DetokParams, **kw: Any) -> DetokRegister:
    return DetokRegister(rid=rid, params=params, prompt_len=3, **kw)


def one_batch(rid: int, pos: int, token_id: int, finish: int = 0) -> TokenBatch:
    return TokenBatch.build([rid], [pos], [token_id], finish=[finish])


def stream_batches(rid: int, ids: list[int], finish: Finish = Finish.LENGTH) -> list[TokenBatch]:
    fin = [0] * (len(ids) - 1) + [int(finish)]
    return [one_batch(rid, p, t, f) for p, (t, f) in enumerate(zip(ids, fin))]


def collect(shard: DetokShard, into: dict[int, list[Any]]) -> None:
    """Drain a shard's text batch into per-rid lists of deltas."""
    batch, _ = shard.take_outputs()
    if batch is not None:
        assert isinstance(batch, TextBatch)
        for delta in batch.items:
            into.setdefault(delta.rid, []).append(delta)


def as_i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)
