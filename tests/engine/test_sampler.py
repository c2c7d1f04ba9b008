"""Sampling filters, penalties, seeds and logprobs behave as OpenAI / vLLM define them."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import sampler
from engine.sampling.sampler import (
    SampleRequest,
    apply_penalties,
    draw,
    filtered_probs,
    mix_seed,
    sample,
)
from wire.params import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _rows(
    params: SamplingParams, n: int, output_ids: list[int] | None = None
) -> list[SampleRequest]:
    return [SampleRequest(params, [0], list(output_ids or [])) for _ in range(n)]


def _frequencies(params: SamplingParams, logits: torch.Tensor, n: int = 20_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    out = sample(logits.expand(n, -1).clone(), _rows(params, n), gen)
    return torch.bincount(out.token_ids, minlength=logits.shape[-1]).float() / n


def test_greedy_takes_the_argmax() -> None:
    out = sample(LOGITS.unsqueeze(0), _rows(SamplingParams(temperature=0.0), 1), torch.Generator())
    assert out.token_ids.tolist() == [0]


def test_temperature_one_draws_from_the_model_distribution() -> None:
    freq = _frequencies(SamplingParams(temperature=1.0), LOGITS)
    torch.testing.assert_close(freq, PROBS, atol=0.015, rtol=0)


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        expected = (LOGITS / t).softmax(-1)
        torch.testing.assert_close(
            _frequencies(SamplingParams(temperature=t), LOGITS), expected, atol=0.015, rtol=0
        )


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=2), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(top_p=0.7), [0.625, 0.375, 0.0, 0.0]),  # 0.5 + 0.3 reaches 0.7
        (SamplingParams(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(top_p=0.01), [1.0, 0.0, 0.0, 0.0]),  # the top token always stays
        (SamplingParams(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # floor 0.1
        (SamplingParams(min_p=0.7), [1.0, 0.0, 0.0, 0.0]),
        (SamplingParams(top_k=3, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ],
)
def test_filters_leave_the_expected_distribution(
    params: SamplingParams, expected: list[float]
) -> None:
    probs = filtered_probs(LOGITS.unsqueeze(0), [params])[0]
    torch.testing.assert_close(probs, torch.tensor(expected), atol=1e-6, rtol=0)


def test_filtered_tokens_are_never_drawn() -> None:
    freq = _frequencies(SamplingParams(top_k=2), LOGITS)
    assert freq[2:].sum() == 0
    torch.testing.assert_close(freq[:2], torch.tensor([0.625, 0.375]), atol=0.015, rtol=0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    row = SampleRequest(SamplingParams(repetition_penalty=2.0), [0], [1])
    out = apply_penalties(logits, [row])
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.5]]
    assert logits.tolist() == [[2.0, -1.0, 3.0, 0.5]]  # the caller's logits are untouched


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [SampleRequest(params, [3, 3], [1, 1, 1, 2])])
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0]]


def test_penalties_apply_to_greedy_requests() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=5.0)
    out = sample(LOGITS.unsqueeze(0), [SampleRequest(params, [0], [])], torch.Generator())
    assert out.token_ids.tolist() == [1]  # token 0 was in the prompt


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    flat = torch.zeros(1, 1000)  # uniform: any change of noise would show
    alone = [
        int(sample(flat, [SampleRequest(params, [0], [5] * p)], torch.Generator()).token_ids[0])
        for p in range(20)
    ]
    other = SamplingParams(temperature=0.7, top_p=0.9)
    for p in range(20):
        rows = [SampleRequest(other, [1], [])] * 3 + [SampleRequest(params, [9, 9], [7] * p)]
        logits = torch.cat([torch.randn(3, 1000), flat])
        got = sample(logits, rows, torch.Generator().manual_seed(p)).token_ids[3]
        assert int(got) == alone[p]
    assert len(set(alone)) > 10  # the position, not just the seed, drives the draw


def test_seeded_draws_follow_the_distribution_across_seeds() -> None:
    tokens = [
        int(
            sample(
                LOGITS.unsqueeze(0), _rows(SamplingParams(seed=s), 1), torch.Generator()
            ).token_ids[0]
        )
        for s in range(4000)
    ]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_mix_seed_separates_positions_and_seeds() -> None:
    values = {mix_seed(s, p) for s in range(50) for p in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**63 for v in values)


def test_logprobs_are_of_the_raw_distribution_with_top_n() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    rows = [
        SampleRequest(SamplingParams(temperature=0.0, logprobs=2), [0], []),
        SampleRequest(SamplingParams(temperature=0.5, top_k=1), [0], []),
    ]
    out = sample(logits, rows, torch.Generator())
    assert out.token_ids.tolist() == [0, 3]
    assert out.logprobs[0].item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert math.isnan(out.logprobs[1].item())  # row 1 asked for none
    assert out.top_ids[0].tolist() == [0, 1]
    torch.testing.assert_close(out.top_logprobs[0], PROBS[:2].log(), atol=1e-6, rtol=0)
    assert tuple(out.top_ids.shape) == (2, 2)


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53])
def test_extreme_uniforms_never_select_a_filtered_token(
    monkeypatch: pytest.MonkeyPatch, u: float
) -> None:
    # The two ends of [0, 1): u = 0 must not pick a zero-mass token before the first
    # live one, and u * total rounding up to the total must not run past the last.
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda n, **k: torch.full((n,), u, dtype=k["dtype"]))
    monkeypatch.setattr(sampler, "uniform", lambda seed, position: u)
    want = [1, 2] if u == 0.0 else [3, 2]
    unseeded = _rows(SamplingParams(temperature=1.0), 2)
    seeded = _rows(SamplingParams(temperature=1.0, seed=5), 2)
    assert draw(probs, unseeded, torch.Generator()).tolist() == want
    assert draw(probs, seeded, torch.Generator()).tolist() == want
    # Probabilities that do not sum to one exactly (a float32 softmax) change nothing.
    assert draw(probs * (1 + 2e-7), seeded, torch.Generator()).tolist() == want


def test_a_seeded_uniform_is_the_hash_of_seed_and_position() -> None:
    values = [sampler.uniform(s, p) for s in range(20) for p in range(20)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == 400
    assert sampler.uniform(3, 7) == (mix_seed(3, 7) >> 10) * 2.0**-53


def test_penalties_of_a_mixed_batch_equal_each_row_alone() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    rows = [
        SampleRequest(SamplingParams(repetition_penalty=1.3), [1, 2, 2], [7]),
        SampleRequest(SamplingParams(), [3], [4, 4]),  # no penalty: left as it is
        SampleRequest(SamplingParams(frequency_penalty=0.4, presence_penalty=0.1), [5], []),
        SampleRequest(
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.2),
            [9] * 30,
            [9, 11, 11],
        ),
    ]
    batched = apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        alone = apply_penalties(logits[i : i + 1], [row])
        torch.testing.assert_close(batched[i : i + 1], alone, atol=0, rtol=0)
    assert torch.equal(batched[1], logits[1])
    v = logits[3, 11].item()  # seen (repetition 0.8), in the output twice (-0.3 each, +0.2)
    assert batched[3, 11].item() == pytest.approx((v / 0.8 if v > 0 else v * 0.8) + 0.6 - 0.2)


def test_only_top_p_rows_are_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    sorted_rows: list[int] = []
    real_sort = torch.Tensor.sort

    def sort(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        sorted_rows.append(self.shape[0])
        return real_sort(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch.Tensor, "sort", sort)
    logits = LOGITS.expand(3, -1).clone()
    plain, top_k = SamplingParams(temperature=1.0), SamplingParams(top_k=2)
    probs = filtered_probs(logits, [plain, top_k, plain])
    assert sorted_rows == []  # top-k alone takes topk, not a vocabulary sort
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[0], PROBS)
    filtered_probs(logits, [plain, SamplingParams(top_p=0.5), top_k])
    assert sorted_rows == [1]


def test_a_seeded_row_draws_the_same_token_alone_and_anywhere_in_a_batch() -> None:
    # A vocabulary that is no multiple of a vector width: rows of a batch start mid-vector.
    g = torch.Generator().manual_seed(11)
    probs = torch.rand(5, 49157, generator=g).pow(8).softmax(-1)
    rows = [
        SampleRequest(SamplingParams(temperature=1.0, seed=s), [1], list(range(n)))
        for s, n in ((3, 4), (3, 5), (9, 0), (1, 77), (2, 2))
    ]
    rows[2] = SampleRequest(SamplingParams(temperature=1.0), [1], [])  # unseeded in between
    batch = draw(probs, rows, torch.Generator().manual_seed(0)).tolist()
    for i in (0, 1, 3, 4):
        alone = draw(probs[i : i + 1].clone(), [rows[i]], torch.Generator().manual_seed(5))
        assert alone.item() == batch[i]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=3, min_p=0.1),
        SamplingParams(temperature=1.0, seed=5),
    ],
)
def test_a_row_masked_whole_still_gets_an_id_inside_the_vocabulary(
    params: SamplingParams,
) -> None:
    """A grammar that allows no token leaves a row of -inf: its pick is an id < V (the
    grammar then refuses it and the request ends), and the other rows are untouched."""

    def mask_row_one(logits: torch.Tensor) -> None:
        logits[1] = float("-inf")

    logits = LOGITS.expand(3, -1).clone()
    out = sample(logits, _rows(params, 3), torch.Generator().manual_seed(0), mask_row_one)
    assert all(0 <= t < LOGITS.shape[0] for t in out.token_ids.tolist())
    if params.greedy:
        assert out.token_ids[[0, 2]].tolist() == [0, 0]
