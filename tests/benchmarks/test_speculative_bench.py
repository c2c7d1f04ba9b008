"""The speculative-decoding benchmark's pooling of sampled streams over seeds."""

from __future__ import annotations

import pytest

from benchmarks.peers.speculative import Stream, pooled


def _stream(ttft: float, times: list[float], tokens: int, drafted: int = 0) -> Stream:
    return Stream(ttft=ttft, times=times, tokens=tokens, drafted=drafted, accepted=drafted // 2)


def test_pooled_streams_give_all_decode_time_over_all_tokens_after_each_first() -> None:
    a = _stream(0.1, [10.0, 10.2, 10.4], tokens=3, drafted=4)  # 0.4 s over 2 tokens
    b = _stream(0.3, [50.0, 51.0], tokens=5, drafted=2)  # 1.0 s over 4 tokens
    c = _stream(0.2, [90.0, 90.6], tokens=2)  # 0.6 s over 1 token
    p = pooled([a, b, c])
    assert p.tpot == pytest.approx((0.4 + 1.0 + 0.6) / (2 + 4 + 1))
    assert p.gaps == pytest.approx([0.2, 0.2, 1.0, 0.6])  # no gap between the streams
    assert p.ttft == 0.2 and (p.drafted, p.accepted) == (6, 3)
