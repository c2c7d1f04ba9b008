"""The cross-host link on loopback: CURVE from a shared key, Hello/Beat, records both ways,
refusals that are quick and logged, bad frames that cost one message, silent peers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("zmq")

import zmq

from transport.errors import ClusterUnavailable, LinkTimeout, PeerGone, PeerRefused
from transport.link.auth import cluster_keypair
from transport.link.client import LinkClient
from transport.link.server import LinkServer
from wire import records
from wire.link_records import LINK_VERSION, Hello
from wire.params import SamplingParams
from wire.records import GenerateRequest, KVRelease, TokenBatch

KEY = "test-cluster-key-0123456789"
OTHER_KEY = "another-cluster-key-9876543210"
LOOPBACK = "127.0.0.1:0"
LOGGER = "transport.link"
DEADLINE_S = 10.0  # a bound for loops that wait on the network, never an assertion


def _records() -> list[records.Control | TokenBatch]:
    return [
        GenerateRequest(
            rid=7,
            prompt_ids=[9707, 11, 1879],
            decode_worker=1,
            detok_shard=0,
            sampling=SamplingParams(max_tokens=5, temperature=0.0, seed=3),
        ),
        KVRelease(rid=7, accepted=True),
        TokenBatch.build(
            rids=[7, 8],
            positions=[0, 3],
            token_ids=[11, 12],
            logprobs=[-0.5, -1.25],
            finish=[0, 1],
            top_ids=np.array([[11, 4], [12, 5]]),
            top_logprobs=np.array([[-0.5, -2.0], [-1.25, -3.0]]),
        ),
    ]


def _until(what: str, cond: Callable[[], bool], step: Callable[[], object] | None = None) -> None:
    """Call ``step`` until ``cond`` holds; fail after DEADLINE_S (or 10,000 rounds)."""
    deadline = time.monotonic() + DEADLINE_S
    for _ in range(10_000):
        if cond():
            return
        if time.monotonic() > deadline:
            break
        if step is not None:
            step()
        else:
            time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


def _connect(server: LinkServer, client: LinkClient, timeout: float = 5.0) -> Hello:
    """Connect while a thread serves the server side (its recv answers the Hello)."""
    stop = threading.Event()

    def serve() -> None:
        for _ in range(1000):
            if stop.is_set():
                return
            server.recv(0.02)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        return client.connect(timeout)
    finally:
        stop.set()
        thread.join(5.0)


@pytest.fixture
def server() -> Iterator[LinkServer]:
    srv = LinkServer(LOOPBACK, KEY, "decode-host", info=b"server layout")
    yield srv
    srv.close()


@pytest.fixture
def client(server: LinkServer) -> Iterator[LinkClient]:
    cli = LinkClient(server.endpoint, KEY, "prefill-host", info=b"client layout")
    yield cli
    cli.close()


def _raw_dealer(ctx: zmq.Context, endpoint: str, own: tuple[bytes, bytes]) -> zmq.Socket:
    """A bare DEALER that speaks CURVE to the server but none of the link protocol."""
    public, _ = cluster_keypair(KEY)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey = public
    sock.curve_publickey, sock.curve_secretkey = own
    sock.connect(f"tcp://{endpoint}")
    return sock


def test_the_server_binds_only_the_address_it_was_given(server: LinkServer) -> None:
    host, port = server.endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_every_node_derives_the_same_keypair_from_the_key() -> None:
    public, secret = cluster_keypair(KEY)
    assert cluster_keypair(KEY) == (public, secret)
    assert zmq.curve_public(secret) == public
    assert cluster_keypair(OTHER_KEY)[0] != public


def test_hellos_are_exchanged_both_ways(server: LinkServer, client: LinkClient) -> None:
    hello = _connect(server, client)
    assert hello == Hello("decode-host", LINK_VERSION, b"server layout")
    [peer] = server.peers.values()
    assert peer.hello == Hello("prefill-host", LINK_VERSION, b"client layout")


def test_records_round_trip_byte_exact_both_ways(server: LinkServer, client: LinkClient) -> None:
    _connect(server, client)
    sent = _records()
    for msg in sent:
        client.send(msg)
    got: list[tuple[bytes, records.Control | TokenBatch]] = []
    _until(
        "the client's records",
        lambda: len(got) == len(sent),
        lambda: got.append(r) if (r := server.recv(0.1)) else None,
    )
    assert [records.encode(m) for _, m in got] == [records.encode(m) for m in sent]
    assert got[0][1] == sent[0] and got[1][1] == sent[1]
    peer = got[0][0]
    assert {p for p, _ in got} == {peer}

    for msg in sent:
        server.send(peer, msg)
    back: list[records.Control | TokenBatch] = []
    _until(
        "the server's records",
        lambda: len(back) == len(sent),
        lambda: back.append(r) if (r := client.recv(0.1)) else None,
    )
    assert [records.encode(m) for m in back] == [records.encode(m) for m in sent]
    batch = back[2]
    assert isinstance(batch, TokenBatch)
    np.testing.assert_array_equal(batch.top_ids, [[11, 4], [12, 5]])


def test_beats_are_heard_and_not_returned_as_records(
    server: LinkServer, client: LinkClient
) -> None:
    _connect(server, client)
    client.send_beat()
    client.send_beat()
    [peer] = server.peers
    _until("two beats", lambda: server.peers[peer].last_beat == 2, lambda: server.recv(0.05))
    assert server.send_beat() == []
    assert client.recv(0.2) is None  # a beat is liveness, not a record


def test_a_wrong_key_is_refused_quickly_and_logged(
    server: LinkServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    intruder = LinkClient(server.endpoint, OTHER_KEY, "intruder")
    try:
        with pytest.raises(PeerRefused, match="cluster-key"):
            # Well inside the timeout: a refusal is reported, not waited out.
            intruder.connect(timeout=30.0)
    finally:
        intruder.close()

    def refused() -> bool:
        return any(
            r.name == LOGGER
            and r.levelno == logging.WARNING
            and "refused a cluster peer" in r.getMessage()
            for r in caplog.records
        )

    _until("the server's refusal log", refused)
    assert server.peers == {}


def test_a_client_without_the_cluster_secret_is_refused_by_zap(
    server: LinkServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Knowing the public key is not enough: the client must hold the cluster's secret."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ctx = zmq.Context()
    try:
        sock = _raw_dealer(ctx, server.endpoint, zmq.curve_keypair())
        monitor = sock.get_monitor_socket()
        events: list[int] = []
        from zmq.utils.monitor import recv_monitor_message

        def step() -> None:
            if monitor.poll(50):
                events.append(recv_monitor_message(monitor)["event"])

        _until("an auth failure", lambda: zmq.EVENT_HANDSHAKE_FAILED_AUTH in events, step)
        sock.disable_monitor()
        monitor.close()
        sock.close()
    finally:
        ctx.term()
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("127.0.0.1" in m and "not the cluster key" in m for m in messages), messages


@pytest.mark.parametrize("key", ["", "short", "x" * 15])
def test_an_empty_or_short_key_is_a_value_error(key: str) -> None:
    with pytest.raises(ValueError, match="cluster key"):
        LinkServer(LOOPBACK, key, "n")
    with pytest.raises(ValueError, match="cluster key"):
        LinkClient("127.0.0.1:1", key, "n")


def test_garbage_costs_one_message_and_the_link_keeps_working(
    server: LinkServer, client: LinkClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _connect(server, client)
    ctx = zmq.Context()
    try:
        # An authenticated peer (it holds the cluster keypair) sending nonsense.
        raw = _raw_dealer(ctx, server.endpoint, cluster_keypair(KEY))
        raw.send(b"\xff\x00garbage")
        raw.send(b"\x01short")  # a TokenBatch kind byte with no header
        raw.send_multipart([b"three", b"frames", b"here"])
        raw.send(records.encode(KVRelease(rid=1, accepted=False)))  # valid, but no Hello
        _until("four dropped messages", lambda: server.bad_frames == 4, lambda: server.recv(0.05))
        raw.close()
    finally:
        ctx.term()
    assert sum("dropped a" in r.getMessage() for r in caplog.records) == 4

    client.send(KVRelease(rid=2, accepted=True))
    got: list[object] = []
    _until(
        "a record after the garbage",
        lambda: bool(got),
        lambda: got.append(r) if (r := server.recv(0.1)) else None,
    )
    assert got[0] == (next(iter(server.peers)), KVRelease(rid=2, accepted=True))


def _a_peer_that_left(server: LinkServer) -> bytes:
    """The routing id of a client that connected, said Hello, and closed."""
    client = LinkClient(server.endpoint, KEY, "leaver")
    try:
        _connect(server, client)
        [peer] = server.peers
    finally:
        client.close()
    return peer


def test_a_client_that_closes_goes_silent_on_the_server(server: LinkServer) -> None:
    peer = _a_peer_that_left(server)
    _until(
        "the closed client to be silent",
        lambda: server.silent_peers(0.2) == [peer],
        lambda: server.recv(0.05),
    )
    server.forget(peer)
    assert server.silent_peers(0.0) == []


def test_a_server_that_stops_beating_goes_silent_on_the_client(
    server: LinkServer, client: LinkClient
) -> None:
    _connect(server, client)
    assert client.silent_peers(60.0) == []
    _until(
        "the server to be silent",
        lambda: client.silent_peers(0.2) == ["decode-host"],
        lambda: client.recv(0.05),
    )


def test_close_is_idempotent_and_stops_the_guard_thread() -> None:
    before = {t.ident for t in threading.enumerate() if t.name == "cluster-link-guard"}
    server = LinkServer(LOOPBACK, KEY, "n")
    client = LinkClient(server.endpoint, KEY, "c")
    client.close()
    client.close()
    server.close()
    server.close()
    after = {t.ident for t in threading.enumerate() if t.name == "cluster-link-guard"}
    assert after <= before


def test_without_zmq_constructing_a_link_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m == "zmq" or m.startswith("zmq.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ClusterUnavailable, match=r"pip install 'pdserve\[nixl\]'"):
        LinkServer(LOOPBACK, KEY, "n")
    with pytest.raises(ClusterUnavailable, match=r"pip install 'pdserve\[nixl\]'"):
        LinkClient("127.0.0.1:1", KEY, "n")


def test_the_module_imports_without_zmq() -> None:
    code = (
        "import sys; sys.modules['zmq'] = None\n"
        "import transport.link.client as link\n"
        "from transport.errors import ClusterUnavailable\n"
        "try:\n"
        f"    link.LinkClient('127.0.0.1:1', {KEY!r}, 'n')\n"
        "except ClusterUnavailable as e:\n"
        "    print(e)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=repo,
        env=env,
    )
    assert "pip install 'pdserve[nixl]'" in out.stdout


def test_a_server_that_never_answers_is_a_link_timeout(server: LinkServer) -> None:
    client = LinkClient(server.endpoint, KEY, "impatient")
    try:  # nobody calls server.recv, so the Hello is never answered
        with pytest.raises(LinkTimeout, match="no Hello"):
            client.connect(timeout=0.5)
    finally:
        client.close()


def test_a_record_for_a_client_that_left_is_peer_gone(server: LinkServer) -> None:
    peer = _a_peer_that_left(server)
    gone: list[bool] = []

    def step() -> None:
        try:
            server.send(peer, KVRelease(rid=3, accepted=True), timeout=0.05)
        except PeerGone:
            gone.append(True)
        time.sleep(0.01)

    _until("PeerGone", lambda: bool(gone), step)
