"""A ring peer run as a real child process by the transport tests.

    python -m tests.transport.ring_peer produce RING_JSON N
    python -m tests.transport.ring_peer consume RING_JSON DOORBELL_JSON N
    python -m tests.transport.ring_peer hold RING_JSON ROLE
    python -m tests.transport.ring_peer launch CAPACITY

Records carry a sequence number and the CRC32 of a variable-length payload, so the
consumer detects any lost, duplicated, reordered or torn record.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from transport.doorbell import Doorbell, DoorbellSpec
from transport.ring import Ring, RingSpec

REPO = Path(__file__).resolve().parents[2]
_HEAD = struct.Struct("<QI")
_POOL = random.Random(1234).randbytes(1 << 16)


def make_record(seq: int) -> bytes:
    n = (seq * 2654435761) % 181  # 0..180 bytes: many wrap positions and paddings
    off = (seq * 40503) % (len(_POOL) - 181)
    payload = _POOL[off : off + n]
    return _HEAD.pack(seq, zlib.crc32(payload)) + payload


def check_record(record: bytes, expected_seq: int) -> None:
    seq, crc = _HEAD.unpack_from(record)
    if seq != expected_seq:
        raise AssertionError(f"record {seq} arrived where {expected_seq} was due")
    if zlib.crc32(record[_HEAD.size :]) != crc or record != make_record(seq):
        raise AssertionError(f"record {seq} is corrupt")


def spawn(*args: str, fds: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.transport.ring_peer", *args]
    return subprocess.Popen(cmd, pass_fds=fds, cwd=REPO, stdout=subprocess.PIPE, text=True)


def ring_fds(spec: RingSpec) -> tuple[int, ...]:
    return (spec.fd, spec.doorbell_fd, spec.space_fd)


def produce(ring: Ring, n: int) -> None:
    for seq in range(n):
        ring.put(make_record(seq), timeout=30.0)


def consume(ring: Ring, bell: Doorbell, n: int) -> int:
    seq = 0
    while seq < n:
        for record in ring.drain(4096):
            check_record(record, seq)
            seq += 1
        if seq < n:
            bell.wait([ring], timeout=1.0)
            if not ring.peer_alive() and not ring.readable():
                break
    return seq


def launch(capacity: int) -> None:
    """Create a ring like the launcher does and run both peers under it, forever."""
    bell = Doorbell.create()
    ring = Ring.create(f"launch{os.getpid()}", capacity, bell)
    spec = ring.spec.to_json()
    producer = spawn("produce", spec, str(10**9), fds=ring_fds(ring.spec))
    consumer = spawn("consume", spec, bell.spec.to_json(), str(10**9), fds=ring_fds(ring.spec))
    print(json.dumps([os.getpid(), producer.pid, consumer.pid]), flush=True)
    signal.pause()


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "launch":
        launch(int(argv[1]))
        return
    spec = RingSpec.from_json(argv[1])
    if mode == "produce":
        produce(Ring.attach(spec, "producer"), int(argv[2]))
        print("produced", flush=True)
    elif mode == "consume":
        bell = Doorbell.attach(DoorbellSpec.from_json(argv[2]))
        print(consume(Ring.attach(spec, "consumer", bell), bell, int(argv[3])), flush=True)
    elif mode == "hold":
        Ring.attach(spec, argv[2])  # type: ignore[arg-type]
        print("attached", flush=True)
        signal.pause()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
