"""Decode-graph plumbing that needs no GPU: buckets, padding, and the one-copy staging."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.cuda.graphs import StepArrays, StepInputs, bucket_for, graph_buckets, pad_decode
from engine.kv.block_table_rows import PAD_ROW


def _i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _decode_arrays(n: int) -> StepArrays:
    """n decode rows with distinct values per field."""
    r = np.arange(n, dtype=np.int32)
    return StepArrays(
        token_ids=100 + r,
        positions=10 + r,
        slots=200 + r,
        seq_rows=1 + r,
        ctx_lens=11 + r,
        logits_rows=r,
        q_starts=np.arange(n + 1, dtype=np.int32),
    )


def test_buckets_cover_every_batch_size_up_to_max_num_seqs() -> None:
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and graph_buckets(256)[-1] == 256
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1] and graph_buckets(8) == [1, 2, 4, 8]
    buckets = graph_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 3, 4, 5, 9, 17, 20)] == [1, 4, 4, 8, 16, 20, 20]
    assert bucket_for(21, buckets) is None  # past the largest: runs eager


def test_padding_rows_write_nothing_and_read_nothing() -> None:
    padded = pad_decode(_decode_arrays(3), 8)
    np.testing.assert_array_equal(padded.token_ids[:3], [100, 101, 102])
    np.testing.assert_array_equal(padded.slots, [200, 201, 202, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(padded.seq_rows[3:], [PAD_ROW] * 5)
    np.testing.assert_array_equal(padded.ctx_lens, [11, 12, 13, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(padded.q_starts, np.arange(9))
    assert padded.num_tokens == padded.num_seqs == 8
    assert all(getattr(padded, f).dtype == np.int32 for f in ("token_ids", "slots", "q_starts"))
    with pytest.raises(AssertionError):
        pad_decode(_decode_arrays(9), 8)


def test_stage_copies_once_into_fixed_views_and_scatters_table_updates() -> None:
    inputs = StepInputs(max_tokens=8, max_seqs=4, max_updates=4, device=torch.device("cpu"))
    views = {name: inputs.view(name, 3) for name in ("token_ids", "slots", "ctx_lens")}
    inputs.stage(_decode_arrays(3), [5, 70, 9, 71])  # two (flat index, block) pairs
    assert views["token_ids"].tolist() == [100, 101, 102]
    assert views["slots"].tolist() == [200, 201, 202]
    assert views["ctx_lens"].tolist() == [11, 12, 13]
    assert inputs.view("q_starts", 4).tolist() == [0, 1, 2, 3]
    table = torch.zeros(3, 4, dtype=torch.int32)
    inputs.apply_updates(table, 2)
    assert table.view(-1)[[5, 9]].tolist() == [70, 71] and int(table.count_nonzero()) == 2

    # A later, different step refills the same views (what a captured graph relies on).
    inputs.stage(_decode_arrays(2), [])
    assert views["token_ids"][:2].tolist() == [100, 101]
    assert inputs.view("token_ids", 3).data_ptr() == views["token_ids"].data_ptr()


def test_a_step_beyond_the_buffers_reallocates_and_bumps_the_generation() -> None:
    inputs = StepInputs(max_tokens=2, max_seqs=2, max_updates=1, device=torch.device("cpu"))
    generation = inputs.generation
    arrays = StepArrays(
        token_ids=_i32(1, 2, 3, 4, 5),
        positions=_i32(0, 1, 2, 3, 0),
        slots=_i32(0, 1, 2, 3, 16),
        seq_rows=_i32(1, 2),
        ctx_lens=_i32(4, 1),
        logits_rows=_i32(3, 4),
        q_starts=_i32(0, 4, 5),
    )
    inputs.stage(arrays, [1, 2, 3, 4, 5, 6])
    assert inputs.generation == generation + 1
    assert (inputs.max_tokens, inputs.max_seqs, inputs.max_updates) == (
        5,
        2,
        3,
    )  # what it needs, at least doubled
    assert inputs.view("token_ids", 5).tolist() == [1, 2, 3, 4, 5]
    assert inputs.view("logits_rows", 2).tolist() == [3, 4]
    table = torch.zeros(8, dtype=torch.int32)
    inputs.apply_updates(table, 3)
    assert table.tolist() == [0, 2, 0, 4, 0, 6, 0, 0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_graphs_recaptured_after_their_buffers_change_share_a_fresh_pool() -> None:
    """A changed key drops every graph, and with them their memory pool: the next capture
    must not reuse the dead pool's handle (the caching allocator asserts on it)."""
    from engine.cuda.graphs import DecodeGraphs

    x = torch.randn(64, 32, device="cuda")
    w = torch.randn(32, 32, device="cuda")

    def forward(bucket: int) -> torch.Tensor:
        return torch.relu(x[:bucket] @ w) + 1.0  # allocates inside the capture

    graphs = DecodeGraphs(forward, torch.device("cuda"))
    for key, buckets in ((1, (1, 8)), (2, (8, 32)), (3, (32, 1))):
        for bucket in buckets:
            torch.testing.assert_close(graphs.run(bucket, key), forward(bucket))
        assert graphs.captured == sorted(buckets)  # captured again, none left eager
