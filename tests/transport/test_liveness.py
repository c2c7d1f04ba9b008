"""PeerWatch with descriptor numbers past 1024: a frontend holding thousands of client
connections opens a restarted peer's pidfd above FD_SETSIZE, where select() refuses it."""

from __future__ import annotations

import mmap
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from transport.liveness import PeerWatch


@pytest.fixture
def many_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the descriptor limit ({hard}) cannot reach past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    yield
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_peer_watched_through_a_pidfd_above_1024_is_seen_to_die(many_fds: None) -> None:
    buf = mmap.mmap(-1, 8)
    slot = np.frombuffer(buf, np.uint64, 1)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        slot[0] = peer.pid  # what the peer writes into the ring header when it attaches
        watch = PeerWatch(slot.__array_interface__["data"][0], "test peer")
        assert watch.alive()
        assert (watch.pidfd() or 0) > 1024
        peer.kill()
        peer.wait()
        deadline = time.monotonic() + 1
        while watch.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.alive()
    finally:
        peer.kill()
        watch.close()
        del slot
        buf.close()
