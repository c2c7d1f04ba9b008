"""SPSC rings: ordering, integrity, back-pressure, wakeups and peer death, across processes."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.transport.ring_peer import check_record, make_record, ring_fds, spawn
from transport.doorbell import Doorbell, DoorbellSpec
from transport.errors import PeerDead, RecordTooLarge, RingFull
from transport.ring import Ring, RingSpec, footprint
from transport.segment import SHM_DIR
from wire import records


@pytest.fixture
def bell() -> Iterator[Doorbell]:
    yield Doorbell.create()


def _pair(bell: Doorbell, capacity: int = 1 << 12) -> tuple[Ring, Ring, Ring]:
    owner = Ring.create(f"t{time.monotonic_ns()}", capacity, bell)
    producer = Ring.attach(owner.spec, "producer")
    consumer = Ring.attach(owner.spec, "consumer", bell)
    return owner, producer, consumer


def _next(ring: Ring) -> bytes | None:
    """The oldest record, copied out and released, or None if the ring is empty."""
    got = ring.drain(1)
    return got[0] if got else None


def test_records_arrive_in_order_and_intact_across_wraparound(bell: Doorbell) -> None:
    _, producer, consumer = _pair(bell, capacity=256)
    for seq in range(5000):  # 256-byte ring: nearly every record wraps at a new offset
        producer.put(make_record(seq), timeout=0)
        check_record(_next(consumer) or b"", seq)
    assert _next(consumer) is None


def test_encoded_records_roundtrip_through_ring(bell: Doorbell) -> None:
    _, producer, consumer = _pair(bell)
    batch = records.TokenBatch.build([7, 9], [0, 3], [11, 12], logprobs=[-0.5, -1.5])
    abort = records.AbortRequest(rid=42)
    producer.put(records.encode(batch))
    producer.put(records.encode(abort))
    got = [records.decode(r) for r in consumer.drain(10)]
    assert isinstance(got[0], records.TokenBatch)
    assert got[0].rids.tolist() == [7, 9] and got[0].logprobs.tolist() == [-0.5, -1.5]
    assert got[1] == abort


def test_full_ring_refuses_then_times_out_without_writing(bell: Doorbell) -> None:
    _, producer, consumer = _pair(bell, capacity=256)
    record = b"x" * 56  # footprint 64: exactly four fit
    assert all(producer.try_put(record) for _ in range(4))
    assert not producer.try_put(record)
    with pytest.raises(RingFull):
        producer.put(record, timeout=0.05)
    assert consumer.drain(100) == [record] * 4
    assert producer.try_put(record)


def test_oversize_record_is_an_error_at_the_producer(bell: Doorbell) -> None:
    _, producer, consumer = _pair(bell, capacity=256)
    assert footprint(248) == 256
    producer.put(b"y" * 248)  # the largest record that fits
    assert _next(consumer) == b"y" * 248
    with pytest.raises(RecordTooLarge, match="249 bytes"):
        producer.put(b"z" * 249)
    assert _next(consumer) is None


def test_reset_discards_records_queued_for_a_dead_consumer(bell: Doorbell) -> None:
    owner, producer, _ = _pair(bell)
    for seq in range(10):
        producer.put(make_record(seq))
    restarted = Ring.attach(owner.spec, "consumer", bell)
    restarted.reset()
    assert _next(restarted) is None
    producer.put(make_record(10))
    check_record(_next(restarted) or b"", 10)


def test_closed_ring_sides_unmap_and_others_keep_working(bell: Doorbell) -> None:
    owner, producer, consumer = _pair(bell)
    producer.put(b"kept")
    owner.close()
    again = Ring.attach(owner.spec, "producer")  # a restarted producer re-attaches by fd
    producer.close()
    again.put(b"more")
    assert consumer.drain(10) == [b"kept", b"more"]


def test_specs_roundtrip_through_json(bell: Doorbell) -> None:
    owner, _, _ = _pair(bell)
    assert RingSpec.from_json(owner.spec.to_json()) == owner.spec
    assert DoorbellSpec.from_json(bell.spec.to_json()) == bell.spec
    assert json.loads(owner.spec.to_json())["capacity"] == 1 << 12


@pytest.mark.slow
def test_million_records_cross_process_in_order_with_checksums(bell: Doorbell) -> None:
    n = 1_000_000
    owner = Ring.create("million", 1 << 16, bell)  # small: wraps and fills constantly
    consumer = Ring.attach(owner.spec, "consumer", bell)
    child = spawn("produce", owner.spec.to_json(), str(n), fds=ring_fds(owner.spec))
    from tests.transport.ring_peer import consume

    assert consume(consumer, bell, n) == n
    assert child.wait(timeout=60) == 0
    assert _next(consumer) is None


@pytest.mark.slow
def test_blocked_producer_resumes_when_child_consumer_drains(bell: Doorbell) -> None:
    n = 20_000
    owner = Ring.create("backpressure", 1 << 10, bell)
    producer = Ring.attach(owner.spec, "producer")
    args = ("consume", owner.spec.to_json(), bell.spec.to_json(), str(n))
    child = spawn(*args, fds=ring_fds(owner.spec))
    for seq in range(n):  # a 1 KiB ring holds ~12 records: put blocks thousands of times
        producer.put(make_record(seq), timeout=30)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and int(out) == n


def _holder(owner: Ring, role: str) -> subprocess.Popen[str]:
    """A child process attached to ``owner`` as ``role``, holding it until it is killed."""
    child = spawn("hold", owner.spec.to_json(), role, fds=ring_fds(owner.spec))
    assert child.stdout is not None and child.stdout.readline().strip() == "attached"
    return child


@pytest.mark.slow
def test_consumer_learns_of_producer_death_within_a_second(bell: Doorbell) -> None:
    owner = Ring.create("pdeath", 1 << 10, bell)
    consumer = Ring.attach(owner.spec, "consumer", bell)
    child = _holder(owner, "producer")
    assert consumer.peer_alive()
    child.send_signal(signal.SIGKILL)
    bell.wait([consumer], timeout=1.0)  # wakes on the pidfd, not on data
    assert not consumer.peer_alive()
    child.wait()


@pytest.mark.slow
def test_producer_blocked_on_full_ring_learns_of_consumer_death(bell: Doorbell) -> None:
    owner = Ring.create("cdeath", 256, bell)
    producer = Ring.attach(owner.spec, "producer")
    child = _holder(owner, "consumer")
    while producer.try_put(b"fill"):
        pass
    child.send_signal(signal.SIGKILL)
    with pytest.raises(PeerDead):
        producer.put(b"more", timeout=1.0)  # PeerDead, not RingFull: known within 1 s
    assert not producer.peer_alive()
    with pytest.raises(PeerDead):  # remembered: later puts fail at once, even with space
        producer.try_put(b"x")
    child.wait()


@pytest.mark.slow
def test_sigkill_of_every_process_leaves_nothing_in_dev_shm() -> None:
    launcher = spawn("launch", str(1 << 12))
    assert launcher.stdout is not None
    pids = json.loads(launcher.stdout.readline())
    time.sleep(0.3)  # let the peers stream records for a while
    assert not list(SHM_DIR.glob(f"pdserve.{pids[0]}.*"))
    pidfds = [os.pidfd_open(pid) for pid in pids]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    launcher.wait()
    for pidfd in pidfds:  # the peers are the launcher's children: wait on them by pidfd
        select.select([pidfd], [], [], 10)
        os.close(pidfd)
    assert not list(SHM_DIR.glob(f"pdserve.{pids[0]}.*"))


@pytest.mark.slow
def test_idle_blocked_consumer_burns_no_cpu(bell: Doorbell) -> None:
    owner = Ring.create("idle", 1 << 10, bell)
    consumer = Ring.attach(owner.spec, "consumer", bell)
    child = _holder(owner, "producer")
    cpu0, wall0 = time.process_time(), time.monotonic()
    while time.monotonic() - wall0 < 1.0:
        bell.wait([consumer], timeout=0.25)
    cpu = time.process_time() - cpu0
    child.kill()
    child.wait()
    assert cpu < 0.05, f"idle consumer used {cpu:.3f}s of CPU in 1s"


def test_doorbell_wakes_an_asyncio_consumer_of_many_rings(bell: Doorbell) -> None:
    rings = [_pair(bell) for _ in range(3)]
    consumers = [c for _, _, c in rings]

    async def consume_all(expected: int) -> list[bytes]:
        loop, got = asyncio.get_running_loop(), []
        done = asyncio.Event()

        def on_bell() -> None:
            bell.clear()
            while True:
                for ring in consumers:
                    got.extend(ring.drain(100))
                if not bell.arm(consumers):
                    break
            if len(got) >= expected:
                done.set()

        loop.add_reader(bell.fileno(), on_bell)
        assert not bell.arm(consumers)
        for i, (_, producer, _) in enumerate(rings):
            loop.call_later(0.01 * (i + 1), producer.put, f"r{i}".encode())
        await asyncio.wait_for(done.wait(), timeout=5)
        loop.remove_reader(bell.fileno())
        return got

    assert sorted(asyncio.run(consume_all(3))) == [b"r0", b"r1", b"r2"]


class _Counted:
    """A watched ring that counts how often the waiter looks at it."""

    def __init__(self, has_data: bool) -> None:
        self.has_data, self.looks = has_data, 0

    def announce_sleep(self) -> None:
        pass

    def readable(self) -> bool:
        self.looks += 1
        return self.has_data

    def peer_pidfd(self) -> int | None:
        return None

    def on_peer_pidfd_ready(self) -> None:
        pass


def test_a_waiter_whose_last_wait_was_long_sleeps_without_spinning(bell: Doorbell) -> None:
    quiet = _Counted(has_data=False)
    bell.wait([quiet], timeout=0.02)  # nothing comes: it ends asleep, 20 ms on
    quiet.looks = 0
    bell.wait([quiet], timeout=0.02)
    # No spin: one look as it announces sleep, one when the sleep times out.
    assert quiet.looks == 2
    ready = _Counted(has_data=True)
    bell.wait([ready], timeout=5.0)  # data already there: seen at the first look
    assert ready.looks == 1
