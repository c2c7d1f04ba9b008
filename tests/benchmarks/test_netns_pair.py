"""The two-namespace stand-in for two hosts: TCP crosses the veth, and nothing is left.

Every connection here goes to an address inside a namespace the test made, and every
loop is bounded in count and time. Skipped with the reason where namespaces cannot be
made (not root, no iproute2, a container without the capability).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.cluster import netns_pair
from benchmarks.cluster.netns_pair import NetnsPair, list_namespaces, sweep_stale

ok, why = netns_pair.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

PORT = 47011  # a fresh namespace has no listeners: any port is free there

# Accepts one connection and echoes until the peer closes; gives up after 10 s.
SERVER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
s.settimeout(10)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(10)
while data := c.recv(65536):
    c.sendall(data)
"""

# Connects (at most 50 tries over ~5 s), sends 20 messages, checks each echo.
CLIENT = """
import socket, sys, time
for attempt in range(50):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("no connection")
for i in range(20):
    msg = (b"%d:" % i) * 1000
    c.sendall(msg)
    got = b""
    while len(got) < len(msg):
        chunk = c.recv(65536)
        if not chunk:
            sys.exit("closed early")
        got += chunk
    assert got == msg, i
print("echoed", i + 1)
"""


def test_tcp_echo_crosses_the_veth_and_the_namespaces_are_gone_after() -> None:
    with NetnsPair() as pair:
        names = set(pair.names.values())
        assert names <= set(list_namespaces())
        server = pair.popen(
            "a",
            [sys.executable, "-c", SERVER, pair.addr("a"), str(PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        sent_before = pair.link_bytes("b")[1]
        client = pair.run(
            "b", [sys.executable, "-c", CLIENT, pair.addr("a"), str(PORT)], timeout=20
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout.strip() == "echoed 20"
        assert server.wait(timeout=10) == 0
        # The bytes went over b's veth end, not some other route.
        payload = sum(len(b"%d:" % i) * 1000 for i in range(20))
        assert pair.link_bytes("b")[1] - sent_before >= payload
    assert not names & set(list_namespaces())


def test_a_body_that_raises_still_removes_namespaces_and_processes() -> None:
    names: set[str] = set()
    with pytest.raises(RuntimeError, match="body failed"), NetnsPair() as pair:
        names = set(pair.names.values())
        sleeper = pair.popen("a", [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("body failed")
    assert names and not names & set(list_namespaces())
    assert sleeper.poll() is not None


def test_sweep_removes_a_namespace_named_for_a_dead_pid() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    stale = f"{netns_pair.PREFIX}{dead.pid}_0a"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        mine = f"{netns_pair.PREFIX}{os.getpid()}_999a"  # a live creator's: left alone
        subprocess.run(["ip", "netns", "add", mine], check=True, timeout=10)
        try:
            removed = sweep_stale()
            assert stale in removed and mine not in removed
            assert stale not in list_namespaces() and mine in list_namespaces()
        finally:
            subprocess.run(["ip", "netns", "del", mine], timeout=10)
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)


def test_each_side_has_cores_of_its_own_that_its_processes_run_on() -> None:
    mine = sorted(os.sched_getaffinity(0))
    with NetnsPair() as pair:
        a, b = pair.cores("a"), pair.cores("b")
        if len(mine) < 2:
            assert a == b == []
            return
        assert a and b and not set(a) & set(b) and sorted(a + b) == mine
        # What a launched node sees: the affinity set before exec, inherited through
        # ``ip netns exec`` (the same pin NetnsLaunch applies).
        probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        proc = pair.popen(
            "b",
            probe,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, b),
        )
        out, _ = proc.communicate(timeout=30)
        assert out.strip() == str(b)
