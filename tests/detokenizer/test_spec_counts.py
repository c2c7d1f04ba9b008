"""DetokShard sums speculation's per-row counts into each delta, for requests that ask.

Rows as a decode worker sends them (``decode/scheduler.py``): a step's first row of a
request carries the drafts it verified, each row whether its token was an accepted draft.
"""

from __future__ import annotations

from typing import Any

import pytest

from detokenizer.shard import DetokShard
from tests.detokenizer.helpers import collect, register
from wire.params import DetokParams
from wire.records import Finish, TokenBatch

K = 4


@pytest.fixture(scope="module")
def table(qwen_tokenizer: Any) -> Any:
    return DetokShard(qwen_tokenizer).table


def _ids(tokenizer: Any, runs: list[int]) -> list[int]:
    """Distinct word tokens, as many as prefill's token and the steps' rows."""
    words = " ".join(f"w{i}" for i in range(40))
    ids = tokenizer.encode(words)[: 1 + sum(m + 1 for m in runs)]
    assert len(ids) == 1 + sum(m + 1 for m in runs)
    return ids


def _steps(ids: list[int], accepted_per_step: list[int]) -> list[TokenBatch]:
    """Prefill's first token, then one batch per decode step: ``m`` accepted drafts of K
    and the token sampled after them; the last row of all ends the request (LENGTH)."""
    out = [TokenBatch.build([1], [0], ids[:1])]
    pos = 1
    for m in accepted_per_step:
        n = min(m + 1, len(ids) - pos)
        positions = list(range(pos, pos + n))
        finish = [int(Finish.LENGTH) if p == len(ids) - 1 else 0 for p in positions]
        out.append(
            TokenBatch.build(
                [1] * n,
                positions,
                ids[pos : pos + n],
                finish=finish,
                drafted=[K] + [0] * (n - 1),
                accepted=[int(j < m) for j in range(n)],
            )
        )
        pos += n
    assert pos == len(ids)
    return out


def _run(
    table: Any, qwen_tokenizer: Any, params: DetokParams, batches: list[TokenBatch]
) -> list[Any]:
    shard = DetokShard(qwen_tokenizer, table=table)
    shard.register(register(1, params))
    deltas: dict[int, list[Any]] = {}
    for b in batches:
        shard.on_tokens(b, 0)
        collect(shard, deltas)
    return deltas[1]


def _sums(deltas: list[Any]) -> tuple[int, int]:
    return sum(d.drafted_tokens for d in deltas), sum(d.accepted_tokens for d in deltas)


def test_counts_are_summed_for_a_request_that_asks(table: Any, qwen_tokenizer: Any) -> None:
    runs = [4, 0, 2, 4]  # 5 + 1 + 3 + 5 decode tokens
    ids = _ids(qwen_tokenizer, runs)
    deltas = _run(table, qwen_tokenizer, DetokParams(count_drafts=True), _steps(ids, runs))
    assert _sums(deltas) == (K * len(runs), sum(runs))
    assert [t for d in deltas for t in d.token_ids] == ids and deltas[-1].finish


def test_counts_are_zero_without_opt_in(table: Any, qwen_tokenizer: Any) -> None:
    runs = [4, 1]
    ids = _ids(qwen_tokenizer, runs)
    for params in (DetokParams(), DetokParams(stop=("zzz",))):  # fast path and slow path
        deltas = _run(table, qwen_tokenizer, params, _steps(ids, runs))
        assert _sums(deltas) == (0, 0)
        assert [t for d in deltas for t in d.token_ids] == ids


def test_a_stop_string_inside_an_accepted_run_cuts_the_accepted_count(
    table: Any, qwen_tokenizer: Any
) -> None:
    """The second step's run of 4 accepted drafts holds the stop string's end at its
    second row: drafts 3 and 4 were verified but are not in the output."""
    runs = [4, 4]
    ids = _ids(qwen_tokenizer, runs)
    stop = qwen_tokenizer.decode(ids[6:8])  # rows 0 and 1 of the second step
    params = DetokParams(stop=(stop,), count_drafts=True)
    deltas = _run(table, qwen_tokenizer, params, _steps(ids, runs))
    assert deltas[-1].finish == Finish.STOP
    assert [t for d in deltas for t in d.token_ids] == ids[:8]
    assert _sums(deltas) == (2 * K, 4 + 2)


def test_counts_survive_rows_arriving_out_of_order(table: Any, qwen_tokenizer: Any) -> None:
    runs = [3, 2]
    ids = _ids(qwen_tokenizer, runs)
    batches = _steps(ids, runs)
    reordered = [batches[0], batches[2], batches[1]]  # a later step parked until its gap fills
    deltas = _run(table, qwen_tokenizer, DetokParams(count_drafts=True), reordered)
    assert _sums(deltas) == (2 * K, 5)
    assert [t for d in deltas for t in d.token_ids] == ids
