"""Segment lifecycle: 0600, unlinked at once, clear error on a small /dev/shm, stale sweep."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import posix_ipc
import pytest

from tests.transport.ring_peer import REPO
from transport.errors import ShmTooSmall
from transport.segment import SHM_DIR, Segment, SegmentSpec, shm_free_bytes, sweep_stale


def test_segment_is_shared_and_leaves_no_name_behind() -> None:
    seg = Segment.create("seg-basic", 1 << 16)
    assert not list(SHM_DIR.glob(f"pdserve.{os.getpid()}.seg-basic"))
    other = Segment.attach(SegmentSpec.from_json(seg.spec.to_json()))
    seg.buf[100:105] = b"hello"
    assert bytes(other.buf[100:105]) == b"hello"
    assert os.fstat(seg.spec.fd).st_mode & 0o777 == 0o600
    other.close()
    seg.close()
    seg.close_fd()


def test_segment_larger_than_free_dev_shm_names_the_docker_fix() -> None:
    with pytest.raises(ShmTooSmall, match=r"--shm-size.*--ipc=host") as err:
        Segment.create("too-big", shm_free_bytes() + (1 << 30))
    assert err.value.needed > err.value.free


def _create_under_size_limit() -> None:  # runs in a child with RLIMIT_FSIZE = 1 MiB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_reservation_failure_is_a_typed_startup_error_not_sigbus() -> None:
    # A 1 MiB file-size limit makes posix_fallocate itself fail, as a full tmpfs would.
    code = (
        "from transport.segment import Segment\n"
        "from transport.errors import ShmTooSmall\n"
        "try:\n    Segment.create('limited', 8 << 20)\n"
        "except ShmTooSmall as e:\n    print('ShmTooSmall', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        preexec_fn=_create_under_size_limit,
        check=True,
    ).stdout
    assert out.startswith("ShmTooSmall") and "--shm-size" in out


def test_sweep_removes_only_names_of_dead_creators() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is certainly dead now
    dead = posix_ipc.SharedMemory(f"/pdserve.{child.pid}.left", posix_ipc.O_CREX, size=64)
    live = posix_ipc.SharedMemory(f"/pdserve.{os.getpid()}.live", posix_ipc.O_CREX, size=64)
    try:
        removed = sweep_stale()
        assert f"pdserve.{child.pid}.left" in removed
        assert (SHM_DIR / f"pdserve.{os.getpid()}.live").exists()
    finally:
        live.unlink()
        for shm in (dead, live):
            shm.close_fd()
