"""cuda_ipc handle bookkeeping: who gets the handle when, and what a transfer's fate is."""

from __future__ import annotations

from transport.kv_handles import HandleSender, PoolImports, Verdict


def test_each_decode_process_gets_the_handle_once_and_a_restarted_one_again() -> None:
    sender = HandleSender()
    assert sender.due({}) == []
    assert sender.due({0: 1}) == [0]
    assert sender.due({0: 1, 1: 1}) == [1]  # decode 1 came up later
    assert sender.due({0: 1, 1: 1}) == []
    assert sender.due({1: 1}) == []  # decode 0 is down: nothing to send
    assert sender.due({0: 2, 1: 1}) == [0]  # decode 0 restarted: its rings were reset


def test_transfers_are_accepted_only_from_mapped_pools() -> None:
    imports = PoolImports()
    assert imports.verdict(0) is Verdict.REFUSE  # no handle yet: refuse and fail visibly
    assert imports.is_new(0, b"h0")
    imports.mapped(0, b"h0")
    assert imports.verdict(0) is Verdict.ACCEPT and not imports.is_new(0, b"h0")
    assert imports.verdict(1) is Verdict.REFUSE


def test_a_dead_prefill_pool_drops_its_transfers_until_its_successor_sends_a_handle() -> None:
    imports = PoolImports()
    imports.mapped(0, b"h0")
    imports.lost(0)
    assert imports.verdict(0) is Verdict.DROP and not imports.is_mapped(0)
    assert imports.is_new(0, b"h0-restarted")
    imports.mapped(0, b"h0-restarted")
    assert imports.verdict(0) is Verdict.ACCEPT
    imports.lost(1)  # never mapped: nothing was lost, transfers stay refused
    assert imports.verdict(1) is Verdict.REFUSE


def test_a_pool_that_cannot_be_mapped_refuses_its_transfers() -> None:
    imports = PoolImports()
    imports.mapped(0, b"h0")
    imports.lost(0)
    imports.failed(0)
    assert imports.verdict(0) is Verdict.REFUSE and not imports.is_mapped(0)
