"""benchmarks.cluster.nixl_link: the pipe framing, the UCX protocol-table reader, and one small
READ across the veth pair (skipped without root namespaces or without NIXL)."""

from __future__ import annotations

import importlib.util
import io

import pytest

from benchmarks.cluster import netns_pair
from benchmarks.cluster.nixl_link import measure_read, read_frame, read_protocol, write_frame


def test_frames_carry_arbitrary_bytes_and_a_short_read_is_an_eof() -> None:
    buf = io.BytesIO()
    payloads = [b"", b"\n\0\xff" * 1000, bytes(range(256))]
    for p in payloads:
        write_frame(buf, p)
    buf.seek(0)
    assert [read_frame(buf) for _ in payloads] == payloads
    with pytest.raises(EOFError):
        read_frame(buf)
    with pytest.raises(EOFError):
        read_frame(io.BytesIO((10).to_bytes(4, "big") + b"abc"))


UCX_LOG = """\
[1.0] [vm:1:0]   | reader self cfg#0                                        |
[1.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1:0]   | Range  | Description |  Config  |
[1.0] [vm:1:0]   | 0..inf | zero-copy   | tcp/lo   |
[1.0] [vm:1:0]   | reader intra-node cfg#1                                  |
[1.0] [vm:1:0]   | active message by ucp_am_send*(egr) from host memory |
[1.0] [vm:1:0]   |      0 | short       | tcp/eth9 |
[1.0] [vm:1:0]   | reader intra-node cfg#1                                  |
[1.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1:0]   +--------+-------------+-------------------------------------------+
[1.0] [vm:1:0]   | Range  | Description |                  Config                   |
[1.0] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                                |
"""


def test_read_protocol_takes_the_peer_read_table_only() -> None:
    assert read_protocol(UCX_LOG) == "zero-copy via cma/memory"
    assert read_protocol("no tables here") == "unknown"


ok, why = netns_pair.available()


@pytest.mark.skipif(not ok, reason=why)
@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="no nixl_cu12")
def test_a_small_read_crosses_the_veth_over_tcp_and_is_notified() -> None:
    with netns_pair.NetnsPair() as pair:
        names = set(pair.names.values())
        r = measure_read(
            pair, "a", "b", transport="tcp", mib=4, desc_kib=256, repeats=1, timeout=30
        )
    assert len(r.seconds) == 1 and r.notifs == 2  # warm-up + timed, each notified
    assert r.reader_veth_rx_bytes is not None and r.reader_veth_rx_bytes >= 2 * (4 << 20)
    assert r.read_protocol == "unknown" or "tcp/" in r.read_protocol
    assert not names & set(netns_pair.list_namespaces())
