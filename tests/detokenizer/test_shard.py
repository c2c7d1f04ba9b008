"""DetokShard: ordering, registration races, finishes, stops, logprob strings, usage."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detokenizer.shard import DetokShard
from tests.detokenizer.helpers import (
    collect,
    id_lists,
    one_batch,
    oracle,
    register,
    stop_oracle,
    stream_batches,
)
from wire.params import DetokParams
from wire.records import AbortRequest, Finish, TokenBatch


@pytest.fixture(scope="module")
def shard_factory(qwen_tokenizer: Any) -> Any:
    template = DetokShard(qwen_tokenizer)  # the vocabulary table is built once

    def make(*rids: int) -> DetokShard:
        """A fresh shard, with requests ``rids`` registered under default parameters."""
        shard = DetokShard(qwen_tokenizer, table=template.table)
        for rid in rids:
            shard.register(register(rid, DetokParams()))
        return shard

    return make


def _text(deltas: list[Any]) -> str:
    return "".join(d.text for d in deltas)


def test_out_of_order_tokens_are_applied_in_position_order(
    shard_factory: Any, qwen_tokenizer: Any
) -> None:
    ids = qwen_tokenizer.encode("Hello world, 你好 😀!")
    shard, out = shard_factory(7), {}
    batches = stream_batches(7, ids)
    for b in [batches[0], *reversed(batches[1:])]:
        shard.on_tokens(b, 0)
        collect(shard, out)
    assert _text(out[7]) == oracle(qwen_tokenizer, ids, True)
    assert [t for d in out[7] for t in d.token_ids] == ids
    assert out[7][-1].finish == Finish.LENGTH
    assert out[7][-1].num_output_tokens == len(ids)


def test_tokens_before_registration_wait_for_it(shard_factory: Any, qwen_tokenizer: Any) -> None:
    ids = qwen_tokenizer.encode("early bird")
    shard, out = shard_factory(), {}
    for b in stream_batches(3, ids)[::-1]:
        shard.on_tokens(b, None)
    collect(shard, out)
    assert out == {}
    shard.register(register(3, DetokParams()))
    collect(shard, out)
    assert _text(out[3]) == "early bird"


def test_late_tokens_for_a_finished_request_are_ignored(shard_factory: Any) -> None:
    shard, out = shard_factory(1), {}
    shard.on_tokens(one_batch(1, 0, 9707, int(Finish.STOP)), 0)
    shard.on_tokens(one_batch(1, 1, 9707), 0)
    collect(shard, out)
    assert [(d.text, d.finish, d.stop_reason) for d in out[1]] == [("Hello", 1, None)]
    assert shard.num_active == 0


@pytest.mark.parametrize(("stop_token_ids", "reason"), [((), None), ((5, 9707), 9707)])
def test_an_engine_stop_names_its_token_only_if_the_request_listed_it(
    shard_factory: Any, stop_token_ids: tuple[int, ...], reason: int | None
) -> None:
    # Unlisted, the stop was an end-of-sequence token: stop_reason None (OpenAI servers).
    shard, out = shard_factory(), {}
    shard.register(register(4, DetokParams(stop_token_ids=stop_token_ids)))
    shard.on_tokens(one_batch(4, 0, 9707, int(Finish.STOP)), 0)
    collect(shard, out)
    assert [(d.finish, d.stop_reason) for d in out[4]] == [(int(Finish.STOP), reason)]


def test_abort_ends_the_request_and_drops_held_text(shard_factory: Any) -> None:
    shard, out = shard_factory(), {}
    shard.register(register(2, DetokParams(stop=("Hello!",))))
    shard.on_tokens(one_batch(2, 0, 9707), None)  # "Hello": held, may start the stop
    shard.abort(2)
    collect(shard, out)
    assert [(d.text, d.finish) for d in out[2]] == [("", Finish.ABORT)]
    assert shard.num_active == 0


def test_stop_string_spanning_tokens_notifies_the_decode_worker(
    shard_factory: Any, qwen_tokenizer: Any
) -> None:
    ids = qwen_tokenizer.encode("The answer is 42. Done, more text")
    shard = shard_factory()
    shard.register(register(5, DetokParams(stop=("Done", "swer is 4"))))
    shard.on_tokens(stream_batches(5, ids)[0], None)
    notified = []
    for b in stream_batches(5, ids)[1:]:
        shard.on_tokens(b, 2)
        notified += shard.take_outputs()[1]
        if notified:
            break
    assert notified == [(2, AbortRequest(rid=5))]
    assert shard.num_active == 0


def test_stop_on_the_prefill_token_notifies_when_decode_tokens_appear(
    shard_factory: Any, qwen_tokenizer: Any
) -> None:
    shard = shard_factory()
    shard.register(register(6, DetokParams(stop=("Hello",))))
    shard.on_tokens(one_batch(6, 0, 9707), None)
    batch, notified = shard.take_outputs()
    assert batch is not None and batch.items[0].stop_reason == "Hello"
    assert notified == []
    shard.on_tokens(one_batch(6, 1, 1879), 3)
    assert shard.take_outputs()[1] == [(3, AbortRequest(rid=6))]


def test_logprob_strings_for_sampled_and_top_tokens(
    shard_factory: Any, qwen_tokenizer: Any
) -> None:
    shard, out = shard_factory(), {}
    shard.register(register(8, DetokParams(), num_logprobs=1))
    top_ids = np.array([[9707, 151645]], dtype=np.int32)
    top_lps = np.array([[-0.1, -2.5]], dtype=np.float32)
    shard.on_tokens(TokenBatch.build([8], [0], [9707], [-0.1], None, top_ids, top_lps), 0)
    collect(shard, out)
    (lp,) = out[8][0].logprobs
    assert lp.token == qwen_tokenizer.decode([9707]) == "Hello"
    assert lp.logprob == pytest.approx(-0.1)
    assert [t for t, _ in lp.top] == ["Hello"]  # trimmed to the request's N=1


def test_reregistration_resumes_without_repeating_text(
    shard_factory: Any, qwen_tokenizer: Any
) -> None:
    ids = qwen_tokenizer.encode("resume me 中")
    shard, out = shard_factory(), {}
    shard.register(register(9, DetokParams(), output_ids=ids[:2]))
    for b in stream_batches(9, ids)[2:]:
        shard.on_tokens(b, 1)
    collect(shard, out)
    assert oracle(qwen_tokenizer, ids[:2], True) + _text(out[9]) == "resume me 中"
    assert out[9][-1].num_output_tokens == len(ids)


_stop_pool = ["a", "the", " ", "中", "😀", "<|im_end|>", "\ufffd", "he", "e t", ",", "!!"]
_params = st.builds(
    DetokParams,
    stop=st.lists(st.sampled_from(_stop_pool), max_size=3).map(tuple),
    include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(),
)
_text_ids = st.text(alphabet=st.sampled_from(list("the cat, 中文 😀!<|im_end|>")), min_size=1)


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.one_of(id_lists, _text_ids),
    params=_params,
    seed=st.integers(0, 2**32 - 1),
)
def test_streamed_text_equals_decode_with_stops_under_any_arrival_order(
    shard_factory: Any, qwen_tokenizer: Any, ids: Any, params: DetokParams, seed: int
) -> None:
    if isinstance(ids, str):
        ids = qwen_tokenizer.encode(ids)
    rng = random.Random(seed)
    batches = stream_batches(4, ids)
    late = batches[1:]
    rng.shuffle(late)
    shard, out = shard_factory(), {}
    shard.register(register(4, params))
    for b in [batches[0], *late]:
        shard.on_tokens(b, 0)
        collect(shard, out)
        assert shard.take_outputs()[0] is None
    final = oracle(qwen_tokenizer, ids, params.skip_special_tokens)
    expected, stop = stop_oracle(final, params.stop, params.include_stop_str_in_output)
    deltas = out[4]
    assert _text(deltas) == expected
    assert deltas[-1].finish == (Finish.STOP if stop is not None else Finish.LENGTH)
    assert deltas[-1].stop_reason == stop
    assert all(d.finish == 0 for d in deltas[:-1])
    streamed = ""
    for d in deltas:
        streamed += d.text
        assert expected.startswith(streamed)


def test_engine_error_row_ends_the_request_without_a_token(qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from detokenizer.shard import DetokShard
    from wire.params import DetokParams
    from wire.records import DetokRegister, Finish, TokenBatch

    shard = DetokShard(qwen_tokenizer)
    shard.register(DetokRegister(rid=9, params=DetokParams(), prompt_len=3))
    shard.on_tokens(TokenBatch.build([9], [0], [-1], finish=[int(Finish.ERROR)]), None)
    text, _ = shard.take_outputs()
    assert text is not None
    (delta,) = text.items
    assert delta.finish == Finish.ERROR and delta.token_ids == [] and delta.text == ""
    assert delta.error


def test_an_error_rows_cause_is_the_clients_message(qwen_tokenizer: Any) -> None:
    """A grammar that allowed no token ends its request saying so; an unknown cause
    gets the generic message."""
    from wire.error_causes import ErrorCause
    from wire.records import DetokRegister

    shard = DetokShard(qwen_tokenizer)
    for rid in (1, 2):
        shard.register(DetokRegister(rid=rid, params=DetokParams(), prompt_len=3))
    ids = [64, 65]  # "a", "b"
    shard.on_tokens(TokenBatch.build([1, 1], [0, 1], ids), None)
    causes = [int(ErrorCause.NO_ALLOWED_TOKEN), -7]
    shard.on_tokens(TokenBatch.build([1, 2], [2, 0], causes, finish=[Finish.ERROR] * 2), None)
    text, _ = shard.take_outputs()
    assert text is not None
    last = {d.rid: d for d in text.items}
    assert last[1].finish == Finish.ERROR and last[1].token_ids == ids
    assert last[1].error is not None and "allowed no next token" in last[1].error
    assert last[2].error == "the engine failed this request"


def test_a_lost_row_ends_the_request_holding_back_what_a_stop_string_might_still_take(
    qwen_tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    """The frontend resumes a LOST request on another shard, which replays its tokens and
    holds back the same text: this shard must not flush it."""
    from detokenizer.shard import DetokShard
    from wire.params import DetokParams
    from wire.records import DetokRegister, Finish, TokenBatch

    ids = qwen_tokenizer.encode("Hello world")
    shard = DetokShard(qwen_tokenizer)
    shard.register(DetokRegister(rid=5, params=DetokParams(stop=(" world!",)), prompt_len=3))
    shard.on_tokens(TokenBatch.build([5] * len(ids), list(range(len(ids))), ids), None)
    shard.on_tokens(TokenBatch.build([5], [len(ids)], [-1], finish=[int(Finish.LOST)]), None)
    text, _ = shard.take_outputs()
    assert text is not None
    (delta,) = text.items
    assert delta.finish == Finish.LOST and delta.error is None
    assert delta.token_ids == ids and delta.text == "Hello"  # " world" may start the stop


def test_ids_past_the_vocabulary_are_reported_as_sampled(qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Padded embedding rows (151646..151935) can be sampled: ids stay exact, text is empty."""
    from detokenizer.shard import DetokShard
    from wire.params import DetokParams
    from wire.records import DetokRegister, TokenBatch

    shard = DetokShard(qwen_tokenizer)
    shard.register(DetokRegister(rid=4, params=DetokParams(), prompt_len=3))
    ids = [9707, 151753, 1879]
    shard.on_tokens(TokenBatch.build([4, 4, 4], [0, 1, 2], ids), 0)
    text, _ = shard.take_outputs()
    assert text is not None
    assert text.items[0].token_ids == ids
    assert text.items[0].text == qwen_tokenizer.decode(ids)


def test_logprob_entries_carry_raw_token_bytes(qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A token holding half a character: its text has U+FFFD, its bytes are exact."""
    import numpy as np

    from detokenizer.shard import DetokShard
    from wire.params import DetokParams
    from wire.records import DetokRegister, TokenBatch

    ids = qwen_tokenizer("🫠").input_ids  # three tokens, each a piece of the emoji's bytes
    assert len(ids) == 3
    shard = DetokShard(qwen_tokenizer)
    shard.register(DetokRegister(rid=1, params=DetokParams(), prompt_len=1, num_logprobs=1))
    top_ids = np.asarray([[i] for i in ids], np.int32)
    lps = [-0.1, -0.2, -0.3]
    top_lps = np.asarray([[lp] for lp in lps], np.float32)
    shard.on_tokens(TokenBatch.build([1] * 3, [0, 1, 2], ids, lps, None, top_ids, top_lps), 0)
    text, _ = shard.take_outputs()
    assert text is not None
    entries = text.items[0].logprobs
    assert entries is not None
    assert b"".join(e.token_bytes for e in entries) == "🫠".encode()
    assert [e.top_bytes[0] for e in entries] == [e.token_bytes for e in entries]


def test_the_first_tokens_cached_prompt_count_rides_on_every_later_delta(
    shard_factory: Any, qwen_tokenizer: Any
) -> None:
    ids = qwen_tokenizer.encode("cached prefix, then more")
    shard, out = shard_factory(5), {}
    shard.register(register(6, DetokParams(stop=("zzz",))))  # not the fast path
    # Prefill's batch: two first tokens with their counts; decode's rows report none (-1).
    shard.on_tokens(TokenBatch.build([5, 6], [0, 0], ids[:2], cached_tokens=[32, 0]), None)
    collect(shard, out)
    for pos, tok in enumerate(ids[1:], start=1):
        fin = [int(Finish.LENGTH)] if pos == len(ids) - 1 else [0]
        shard.on_tokens(TokenBatch.build([5], [pos], [tok], finish=fin), 0)
        collect(shard, out)
    assert [d.cached_tokens for d in out[5]] == [32] * len(out[5]) and out[5][-1].finish
    assert out[6][0].cached_tokens == 0


def test_a_cached_count_that_arrives_before_registration_is_kept(shard_factory: Any) -> None:
    shard, out = shard_factory(), {}
    shard.on_tokens(TokenBatch.build([9], [1], [11], finish=[int(Finish.LENGTH)]), 0)
    shard.on_tokens(TokenBatch.build([9], [0], [10], cached_tokens=[48]), None)
    shard.register(register(9, DetokParams()))
    collect(shard, out)
    assert out[9][-1].cached_tokens == 48 and out[9][-1].finish == Finish.LENGTH


@pytest.mark.parametrize("per_step", [3, 5])
def test_several_tokens_a_step_stream_what_one_a_step_does(
    shard_factory: Any, qwen_tokenizer: Any, per_step: int
) -> None:
    """Speculative decoding sends a request's accepted run as several rows of one batch:
    a stop string that ends inside the run cuts the text, token ids, logprobs and usage
    exactly where one token a step would, and the rows after it are dropped."""
    ids = qwen_tokenizer.encode("The answer is 42. Done, and more text after the stop")

    def run(rows: int) -> list[Any]:
        shard = shard_factory()
        shard.register(register(5, DetokParams(stop=("Done",)), num_logprobs=1))
        deltas: list[Any] = []
        for start in range(0, len(ids), rows):
            toks = ids[start : start + rows]
            positions = list(range(start, start + len(toks)))
            batch = TokenBatch.build(
                [5] * len(toks),
                positions,
                toks,
                logprobs=[-0.5 - p for p in positions],
                top_ids=np.array([[t] for t in toks]),
                top_logprobs=np.zeros((len(toks), 1)),
            )
            shard.on_tokens(batch, 0)
            text = shard.take_outputs()[0]
            deltas += text.items if text is not None else []
        return deltas

    def folded(deltas: list[Any]) -> tuple[Any, ...]:
        last = deltas[-1]
        return (
            _text(deltas),
            [t for d in deltas for t in d.token_ids],
            [lp.logprob for d in deltas for lp in d.logprobs or []],
            last.finish,
            last.stop_reason,
            last.num_output_tokens,
        )

    one, many = folded(run(1)), folded(run(per_step))
    assert many == one
    assert one[0] == "The answer is 42. " and one[3] == Finish.STOP and one[4] == "Done"
