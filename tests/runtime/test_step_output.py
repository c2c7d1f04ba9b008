"""A token its grammar refuses (the mask allowed none) ends that one request with an
error row saying why; the other rows of the step are emitted as ever."""

from __future__ import annotations

import math

from engine.kv.sequence import Sequence
from runtime.step_output import TokenBatcher
from wire.error_causes import ErrorCause
from wire.records import Finish


class _Grammar:
    """A matcher stand-in: refuses every token but ``ok``."""

    def __init__(self, ok: int) -> None:
        self.ok, self.failed, self.terminated = ok, False, False

    def accept(self, token: int) -> bool:
        self.failed = self.failed or token != self.ok
        return not self.failed


def _never_stops(seq: Sequence) -> Finish:
    return Finish.NONE


def test_a_refused_token_ends_its_request_with_an_error_row() -> None:
    refused, fine, free = Sequence(1, [5, 6]), Sequence(2, [5]), Sequence(3, [7])
    refused.grammar, fine.grammar = _Grammar(ok=10), _Grammar(ok=11)  # type: ignore[assignment]
    batcher = TokenBatcher()
    finishes = [
        batcher.emit(seq, 0, token, row, -0.5, _never_stops)
        for row, (seq, token) in enumerate([(refused, 99), (fine, 11), (free, 12)])
    ]
    assert finishes == [Finish.ERROR, Finish.NONE, Finish.NONE]
    batch = batcher.batches(None)[0]
    assert batch.rids.tolist() == [1, 2, 3]
    assert batch.positions.tolist() == [0, 0, 0]
    assert batch.token_ids.tolist() == [int(ErrorCause.NO_ALLOWED_TOKEN), 11, 12]
    assert batch.finish.tolist() == [Finish.ERROR, Finish.NONE, Finish.NONE]
    assert math.isnan(batch.logprobs[0]) and batch.logprobs[1] == -0.5
