"""The torch path's adapter bank: decode-sized steps apply every resident adapter at once
(stacked, masked), larger steps one adapter at a time; both add to each row exactly its
own adapter's update, in float32 against the per-row math."""

from __future__ import annotations

import pytest
import torch

from engine.weights.lora import GATHER_ROWS, LoraBank, group_rows, lora_rows

K, N = 48, 40


def _bank(g: torch.Generator) -> tuple[LoraBank, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    bank = LoraBank(4)
    pairs = {}
    for slot, r in ((0, 8), (1, 16), (3, 4)):  # slot 2: an adapter not touching this layer
        a, b = torch.randn(r, K, generator=g), torch.randn(N, r, generator=g)
        bank.set(slot, a, b)
        pairs[slot] = (a, b)
    return bank, pairs


@pytest.mark.parametrize("rows", [1, 7, GATHER_ROWS, GATHER_ROWS + 9])
def test_each_row_gets_its_own_adapters_update_on_both_paths(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    bank, pairs = _bank(g)
    slots = [[1, -1, 0, 3, 2, 1][i % 6] for i in range(rows)]
    x, y = torch.randn(rows, K, generator=g), torch.randn(rows, N, generator=g)
    want = y.clone()
    for i, s in enumerate(slots):
        if s in pairs:
            a, b = pairs[s]
            want[i] += x[i] @ a.T @ b.T
    got = y.clone()
    with lora_rows(group_rows(slots, x.device)):
        assert bank(x, got) is got  # in place, into the base output
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    untouched = [i for i, s in enumerate(slots) if s not in pairs]
    assert torch.equal(got[untouched], y[untouched])


def test_one_adapter_over_every_row_and_no_adapter_at_all() -> None:
    g = torch.Generator().manual_seed(1)
    bank, pairs = _bank(g)
    x, y = torch.randn(5, K, generator=g), torch.randn(5, N, generator=g)
    with lora_rows(group_rows([-1] * 5, x.device)):
        assert torch.equal(bank(x, y.clone()), y)
    with lora_rows(group_rows([3] * 5, x.device)):
        got = bank(x, y.clone())
    a, b = pairs[3]
    torch.testing.assert_close(got, y + x @ a.T @ b.T, atol=1e-4, rtol=1e-4)


def test_clearing_a_slot_restacks_the_rest_and_frees_it_all_when_empty() -> None:
    g = torch.Generator().manual_seed(2)
    bank, pairs = _bank(g)
    held = bank.nbytes
    assert held == sum(a.nbytes + b.nbytes for a, b in pairs.values())  # one copy, stacked
    bank.clear(1)
    assert bank.nbytes == held - pairs[1][0].nbytes - pairs[1][1].nbytes
    x, y = torch.randn(3, K, generator=g), torch.randn(3, N, generator=g)
    with lora_rows(group_rows([0, 1, 3], x.device)):
        got = bank(x, y.clone())
    assert torch.equal(got[1], y[1])  # slot 1 is gone: its row is base now
    for i, s in ((0, 0), (2, 3)):
        a, b = pairs[s]
        torch.testing.assert_close(got[i], y[i] + x[i] @ a.T @ b.T, atol=1e-4, rtol=1e-4)
    bank.clear(0)
    bank.clear(3)
    assert bank.nbytes == 0
