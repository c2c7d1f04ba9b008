"""The TokenBatch codec carries the first token's cached prompt count and speculation's counts,
checks its row layout; KVTransfer carries its hashes."""

from __future__ import annotations

import numpy as np
import pytest

from wire.params import SamplingParams
from wire.records import KVTransfer, RecordError, TokenBatch, decode, encode


def test_cached_tokens_round_trip_on_the_rows_that_carry_them() -> None:
    top = np.arange(6, dtype=np.int32).reshape(3, 2)
    batch = TokenBatch.build(
        [1, 2, 3],
        [0, 5, 0],
        [10, 11, 12],
        [-0.5, -1.0, -2.0],
        [0, 1, 0],
        top,
        -top.astype(np.float32),
        cached_tokens=[48, -1, 0],
    )
    got = decode(encode(batch))
    assert isinstance(got, TokenBatch) and got.cached_tokens is not None
    assert got.cached_tokens.tolist() == [48, -1, 0]
    assert got.rids.tolist() == [1, 2, 3] and got.finish.tolist() == [0, 1, 0]
    assert got.top_ids.tolist() == top.tolist()


def _without_optional_columns(cols: TokenBatch) -> TokenBatch:
    """``cols``'s required columns as separate arrays, the optional ones left out."""
    return TokenBatch(
        cols.rids.copy(),
        cols.positions.copy(),
        cols.token_ids.copy(),
        cols.logprobs.copy(),
        cols.finish.copy(),
        cols.top_ids,
        cols.top_logprobs,
    )


def test_batches_built_or_made_without_the_column_read_as_not_reported() -> None:
    built = decode(encode(TokenBatch.build([7], [3], [9])))
    assert isinstance(built, TokenBatch) and built.cached_tokens is not None
    assert built.cached_tokens.tolist() == [-1]
    cols = TokenBatch.build([4, 5], [0, 1], [6, 7], cached_tokens=[16, -1])
    plain = _without_optional_columns(cols)
    got = decode(encode(plain))
    assert isinstance(got, TokenBatch) and got.cached_tokens is not None
    assert got.cached_tokens.tolist() == [-1, -1] and got.token_ids.tolist() == [6, 7]


def test_kv_transfer_carries_block_hashes_and_defaults_to_none() -> None:
    common = dict(
        rid=1,
        prefill_worker=0,
        src_blocks=[3, 4],
        num_tokens=20,
        prompt_ids=[1] * 20,
        output_ids=[2],
        sampling=SamplingParams(),
        detok_shard=0,
    )
    with_hashes = KVTransfer(**common, block_hashes=[2**64 - 1])  # type: ignore[arg-type]
    assert decode(encode(with_hashes)) == with_hashes
    assert decode(encode(KVTransfer(**common))).block_hashes == []  # type: ignore[arg-type, union-attr]


def test_speculation_counts_round_trip_and_read_as_zero_when_absent() -> None:
    batch = TokenBatch.build([1, 1, 1, 2], [4, 5, 6, 9], [10, 11, 12, 13], drafted=[4, 0, 0, 0])
    got = decode(encode(batch))
    assert isinstance(got, TokenBatch) and got.drafted is not None and got.accepted is not None
    assert got.drafted.tolist() == [4, 0, 0, 0] and got.accepted.tolist() == [0, 0, 0, 0]
    batch = TokenBatch.build([1, 1], [4, 5], [10, 11], drafted=[16, 0], accepted=[1, 0])
    got = decode(encode(batch))
    assert isinstance(got, TokenBatch) and got.drafted is not None and got.accepted is not None
    assert got.drafted.tolist() == [16, 0] and got.accepted.tolist() == [1, 0]
    assert got.cached_tokens is not None and got.cached_tokens.tolist() == [-1, -1]
    cols = TokenBatch.build([4], [0], [6])  # columns not sharing one record array
    plain = _without_optional_columns(cols)
    got = decode(encode(plain))
    assert isinstance(got, TokenBatch) and got.drafted is not None and got.accepted is not None
    assert (got.drafted.tolist(), got.accepted.tolist()) == ([0], [0])


def test_a_token_batch_of_another_row_layout_is_refused() -> None:
    raw = bytearray(encode(TokenBatch.build([1], [0], [5])))
    raw[1] = 0  # the pad byte of a batch written before rows were versioned
    with pytest.raises(RecordError, match="row layout 0"):
        decode(bytes(raw))
