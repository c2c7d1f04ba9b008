"""The ``nixl`` KV backend alone: two NIXL agents in this process stand for a prefill and
a decode worker on two hosts (UCX picks its in-host transports here; the two-namespace
tests put a real link between them)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from transport import kv_nixl, nixl_agent
from transport.errors import KVTransferError
from transport.kv_nixl import NixlExporter, NixlReceiver
from wire.kv_layout import KVLayout
from wire.records import KVRelease

try:
    NIXL = nixl_agent.load_nixl()
except nixl_agent.NixlUnavailable as e:  # pragma: no cover - the test extra installs it
    pytest.skip(str(e), allow_module_level=True)

LAYOUT = KVLayout(
    num_blocks=12, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16"
)


def _pool(layout: KVLayout, fill: float | None = None) -> torch.Tensor:
    if fill is None:
        return torch.randn(layout.shape).to(layout.torch_dtype)
    return torch.full(layout.shape, fill, dtype=layout.torch_dtype)


Pair = tuple[NixlExporter, NixlReceiver, torch.Tensor, torch.Tensor]


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    tag = request.node.name.replace("[", "-").replace("]", "")
    src_pool, dst_pool = _pool(LAYOUT), _pool(LAYOUT, fill=-7.0)
    exporter = kv_nixl.NixlExporter(src_pool, LAYOUT, f"prefill-{tag}", nixl=NIXL)
    receiver = kv_nixl.NixlReceiver(dst_pool, LAYOUT, f"decode-{tag}", timeout_s=20, nixl=NIXL)
    receiver.open(0, exporter.handle())
    exporter.serve_reads(True)
    yield exporter, receiver, src_pool, dst_pool
    receiver.close()
    exporter.close()


def _wait_releases(exporter: NixlExporter, want: int) -> list[KVRelease]:
    got: list[KVRelease] = []
    for _ in range(500):  # bounded: notifications follow the READ within milliseconds
        got += exporter.releases()
        if len(got) >= want:
            break
        time.sleep(0.01)
    return got


def test_a_handoff_copies_its_blocks_and_releases_through_the_read(pair: Pair) -> None:
    exporter, receiver, src, dst = pair
    src_blocks, dst_blocks = [5, 6, 7, 2], [0, 1, 2, 9]
    receiver.fetch(0, src_blocks, dst_blocks, notify=kv_nixl.release_notification(41))
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert torch.equal(dst[d], src[s])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in dst_blocks]
    assert bool((dst[untouched] == -7.0).all())
    assert receiver.bytes_read == 4 * LAYOUT.block_nbytes and receiver.reads == 1
    assert _wait_releases(exporter, 1) == [KVRelease(rid=41, accepted=True)]


def test_a_partial_handoff_moves_only_the_missing_blocks(pair: Pair) -> None:
    exporter, receiver, src, dst = pair
    # decode already holds the first two blocks of the prompt (a prefix-cache hit): it
    # asks for the last two of the four only.
    prompt_blocks, missing = [3, 4, 8, 11], [8, 11]
    dst[[0, 1]] = src[[3, 4]]
    receiver.fetch(0, missing, [2, 3], notify=kv_nixl.release_notification(7))
    for s, d in zip(prompt_blocks, [0, 1, 2, 3], strict=True):
        assert torch.equal(dst[d], src[s])
    assert receiver.bytes_read == 2 * LAYOUT.block_nbytes
    assert _wait_releases(exporter, 1) == [KVRelease(rid=7, accepted=True)]


def test_a_full_prefix_hit_moves_nothing_but_still_releases(pair: Pair) -> None:
    exporter, receiver, _, _ = pair
    receiver.fetch(0, [], [], notify=kv_nixl.release_notification(9))
    assert receiver.bytes_read == 0 and receiver.reads == 0
    assert _wait_releases(exporter, 1) == [KVRelease(rid=9, accepted=True)]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"head_dim": 16}, "head_dim 16 (here 8)"),
        ({"dtype": "float32"}, "dtype float32"),
        ({"block_size": 8}, "block_size 8"),
        ({"num_kv_heads": 4}, "num_kv_heads 4"),
    ],
)
def test_a_pool_of_another_layout_is_refused_with_the_fields_named(
    change: dict[str, object], named: str
) -> None:
    other = dataclasses.replace(LAYOUT, **change)  # type: ignore[arg-type]
    exporter = kv_nixl.NixlExporter(_pool(other), other, f"prefill-bad-{named[:6]}", nixl=NIXL)
    receiver = kv_nixl.NixlReceiver(_pool(LAYOUT), LAYOUT, f"decode-bad-{named[:6]}", nixl=NIXL)
    try:
        with pytest.raises(nixl_agent.KVLayoutMismatch, match=re.escape(named)):
            receiver.open(0, exporter.handle())
        assert 0 not in receiver.sources
        with pytest.raises(KVTransferError, match="no nixl pool open"):
            receiver.fetch(0, [0], [0])
    finally:
        receiver.close()
        exporter.close()


def test_only_the_block_count_may_differ() -> None:
    bigger = KVLayout(
        num_blocks=40, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16"
    )
    nixl_agent.check_compatible(LAYOUT, bigger)
    src = _pool(bigger)
    exporter = kv_nixl.NixlExporter(src, bigger, "prefill-bigger", nixl=NIXL)
    exporter.serve_reads(True)
    receiver = kv_nixl.NixlReceiver(_pool(LAYOUT, 0.0), LAYOUT, "decode-bigger", nixl=NIXL)
    try:
        receiver.open(3, exporter.handle())
        receiver.fetch(3, [39, 20], [0, 11])
        assert torch.equal(receiver.pool[0], src[39]) and torch.equal(receiver.pool[11], src[20])
        with pytest.raises(KVTransferError, match="source block id out of range"):
            receiver.fetch(3, [40], [1])  # past the remote pool, though within ours
    finally:
        receiver.close()
        exporter.close()


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "message"),
    [
        ([0, 1], [2], "2 source blocks for 1"),
        ([12], [0], "source block id out of range"),
        ([0], [-1], "destination block id out of range"),
        ([1, 1], [2, 3], "repeat"),
    ],
)
def test_bad_block_ids_are_refused_and_nothing_is_copied(
    pair: Pair, src_blocks: list[int], dst_blocks: list[int], message: str
) -> None:
    _, receiver, _, dst = pair
    with pytest.raises(KVTransferError, match=message):
        receiver.fetch(0, src_blocks, dst_blocks)
    assert bool((dst == -7.0).all()) and receiver.bytes_read == 0


def test_a_restarted_prefill_pool_replaces_the_old_one(pair: Pair) -> None:
    _, receiver, _, dst = pair
    fresh_pool = _pool(LAYOUT)
    fresh = kv_nixl.NixlExporter(fresh_pool, LAYOUT, "prefill-restarted", nixl=NIXL)
    fresh.serve_reads(True)
    try:
        receiver.open(0, fresh.handle())
        receiver.fetch(0, [1], [1])
        assert torch.equal(dst[1], fresh_pool[1])
        receiver.drop(0)
        with pytest.raises(KVTransferError, match="no nixl pool open"):
            receiver.fetch(0, [1], [1])
    finally:
        fresh.close()


def test_an_unreadable_handle_is_a_transfer_error() -> None:
    receiver = kv_nixl.NixlReceiver(_pool(LAYOUT), LAYOUT, "decode-garbage", nixl=NIXL)
    try:
        with pytest.raises(KVTransferError, match="unreadable nixl pool handle"):
            receiver.open(0, b"\x93not a handle")
    finally:
        receiver.close()


def test_an_exporter_with_nothing_to_serve_costs_no_cpu() -> None:
    """Its agent is progressed only while reads may come: idle, the process sleeps."""
    exporter = kv_nixl.NixlExporter(_pool(LAYOUT), LAYOUT, "prefill-idle", nixl=NIXL)
    try:
        exporter.serve_reads(True)
        exporter.serve_reads(False)
        before = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - before < 0.5  # a polling agent would take the whole second
    finally:
        exporter.close()


def test_without_nixl_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "nixl._api", "nixl_cu13", "nixl_cu12"):
        monkeypatch.setitem(sys.modules, name, None)  # import of each now fails
    with pytest.raises(nixl_agent.NixlUnavailable, match=r"pdserve\[nixl\]"):
        nixl_agent.load_nixl()
    with pytest.raises(nixl_agent.NixlUnavailable):
        kv_nixl.NixlReceiver(_pool(LAYOUT), LAYOUT, "decode-none")


def _serve_pool(conn: Connection) -> None:
    """A prefill process: exports a pool, sends its handle, then waits to be killed."""
    torch.manual_seed(0)
    exporter = kv_nixl.NixlExporter(_pool(LAYOUT), LAYOUT, f"prefill-child-{os.getpid()}")
    exporter.serve_reads(True)
    conn.send_bytes(exporter.handle())
    conn.send_bytes(exporter.pool.view(torch.uint8).numpy().tobytes())
    time.sleep(120)


@contextlib.contextmanager
def _child_pool(
    name: str, timeout_s: float
) -> Iterator[tuple[mp.Process, NixlReceiver, torch.Tensor]]:
    """A prefill process serving a pool (``_serve_pool``), a receiver that opened it, and
    the pool's bytes as the child sent them: (process, receiver, blocks as byte rows)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_pool, args=(child,), daemon=True)
    proc.start()
    receiver = kv_nixl.NixlReceiver(_pool(LAYOUT, 0.0), LAYOUT, name, timeout_s=timeout_s)
    try:
        assert parent.poll(60)
        receiver.open(0, parent.recv_bytes())
        src = torch.frombuffer(bytearray(parent.recv_bytes()), dtype=torch.uint8)
        yield proc, receiver, src.view(LAYOUT.num_blocks, -1)
    finally:
        receiver.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid or 0, signal.SIGCONT)  # a test may have stopped it
        proc.kill()
        proc.join(10)


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (state T in /proc), at most 10 s."""
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{pid}/task")
    while any(
        (t / "stat").read_text().rsplit(")", 1)[1].split()[0] != "T" for t in tasks.iterdir()
    ):
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.001)


def _received(receiver: NixlReceiver, block: int) -> torch.Tensor:
    return receiver.pool[block].view(torch.uint8).flatten()


def test_a_read_from_a_dead_prefill_process_fails_cleanly() -> None:
    """The prefill host dies between two handoffs: the next READ raises a transfer error
    within the receiver's deadline (the request is then refused and re-prefilled)."""
    with _child_pool("decode-orphan", timeout_s=10) as (proc, receiver, blocks):
        receiver.fetch(0, [4], [4])  # across processes, as between hosts
        assert torch.equal(_received(receiver, 4), blocks[4])
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(KVTransferError, match="prefill 0"):
            receiver.fetch(0, [5], [5])


def test_a_read_in_flight_is_polled_and_one_from_a_stopped_source_ends_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX over TCP, as between hosts: the source's own progress serves a READ, so a read
    from a stopped prefill process stays in flight past the receiver's deadline; the
    caller polls it between steps of its own and is never blocked, and may free the
    destination blocks only once the read has ended."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read at agent creation, here and in the child
    with _child_pool("decode-inflight", timeout_s=2) as (proc, receiver, blocks):
        read = receiver.start_fetch(0, [1, 2, 3], [7, 8, 9])
        deadline = time.monotonic() + 10
        while read is not None and not read.poll():  # bounded by the read's own deadline
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for s, d in ((1, 7), (2, 8), (3, 9)):
            assert torch.equal(_received(receiver, d), blocks[s])
        assert receiver.reads == 1

        os.kill(proc.pid or 0, signal.SIGSTOP)
        _wait_stopped(proc.pid or 0)  # kill() returns before every thread has stopped
        read = receiver.start_fetch(0, [5], [5])
        assert read is not None, "a stopped source cannot have served the READ"
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="did not finish in 2"):
            while not read.poll():
                assert time.monotonic() - t0 < 10
                time.sleep(0.01)
        # NIXL cannot recall a READ in flight: its blocks stay held until it has ended.
        assert not read.abandon()
        os.kill(proc.pid or 0, signal.SIGCONT)
        t0 = time.monotonic()
        while not read.abandon():  # the source serves it, late; then it is over
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        assert receiver.reads == 1  # an abandoned read is not counted as moved


def test_pools_whose_blocks_are_ordered_differently_are_refused() -> None:
    """A fused-CPU worker's blocks (the kernel library's order) are not a torch worker's."""
    fused = dataclasses.replace(LAYOUT, order="vec16")
    with pytest.raises(nixl_agent.KVLayoutMismatch, match="order vec16 \\(here tokens\\)"):
        nixl_agent.check_compatible(LAYOUT, fused)
