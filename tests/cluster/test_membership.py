"""The pure parts of several hosts: flags, who a head admits, the rings and rows a node
builds for peers on other hosts, and load-table rows as they cross."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from cluster.gateway import Gateway
from cluster.membership import GatewaySpec, Member, join_refusal
from launcher import cluster
from launcher.args import parse_args
from launcher.cli import main
from launcher.settings import ConfigError
from launcher.topology import Topology
from transport.load_table import LoadTable, WorkerState, row_fields, row_from_fields
from wire.kv_layout import KVLayout
from wire.link_records import Join, Rows
from wire.ring_names import Peer, RingKind, RingName
from wire.roles import Role

KEY = ["--cluster-key", "sixteen-chars-or-more"]
LAYOUT = KVLayout(num_blocks=64, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--advertise", "10.0.0.1", *KEY], "--remote-decode"),
        (["--remote-decode", "2", *KEY], "needs --advertise"),
        (shlex.split("--advertise 10.0.0.1 --remote-decode 1"), "--cluster-key"),
        (
            shlex.split("--advertise 10.0.0.1 --remote-decode 1 --cluster-key short"),
            "16 characters",
        ),
        ([*shlex.split("--join 10.0.0.1:7481 --decode 2"), *KEY], "--prefill 0"),
        ([*shlex.split("--join 10.0.0.1 --prefill 0"), *KEY], "HOST:PORT"),
        ([*shlex.split("--join h:1 --advertise h --prefill 0"), *KEY], "exclude each other"),
        (shlex.split("--prefill 1 --decode 0"), "--decode must be >= 1"),
    ],
)
def test_cluster_flags_that_contradict_are_refused_naming_the_flag(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_a_head_may_bring_no_decode_worker_of_its_own() -> None:
    c = parse_args([*shlex.split("--decode 0 --remote-decode 2 --advertise 10.0.0.1"), *KEY])
    assert c.clustered and cluster.remote_decode(c) == [0, 1]
    m = parse_args([*shlex.split("--prefill 0 --decode 3 --join 10.0.0.1:7481"), *KEY])
    assert m.clustered and m.join == "10.0.0.1:7481"


def test_the_cluster_key_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CLUSTER_KEY", "from-the-environment-key")
    c = parse_args(shlex.split("--prefill 0 --join 10.0.0.1:7481"))
    assert c.cluster_key == "from-the-environment-key"


def _spec(reserve: list[int]) -> GatewaySpec:
    return GatewaySpec(
        log_level="info",
        node="a",
        cluster_key="k" * 16,
        listen="h:1",
        join="",
        num_prefill=1,
        decode=reserve,
        shape="{}",
        layout=LAYOUT.to_json(),
        model="m",
        beat_s=0.2,
        silent_after_s=2.0,
    )


def _join(node: str = "b", decode: int = 1, layout: KVLayout = LAYOUT, model: str = "m") -> Join:
    return Join(node, decode, layout.to_json(), model)


def test_a_node_joining_again_gets_back_the_indices_its_workers_run_under() -> None:
    """After the head's gateway restarted it knows no member: each joins again naming the
    first index its decode workers already run under, in whatever order they come."""
    spec, members = _spec([2, 3, 4]), {}
    again = Join("c", 2, LAYOUT.to_json(), "m", base=3)
    assert join_refusal(again, spec, LAYOUT, members) == ""
    members["c"] = Member("c", [3, 4])
    assert "not free" in join_refusal(
        Join("b", 2, LAYOUT.to_json(), "m", base=2), spec, LAYOUT, members
    )
    assert join_refusal(Join("b", 1, LAYOUT.to_json(), "m", base=2), spec, LAYOUT, members) == ""
    assert "not free" in join_refusal(
        Join("d", 1, LAYOUT.to_json(), "m", base=7), spec, LAYOUT, members
    )
    assert join_refusal(again, spec, LAYOUT, members) == ""  # the same node, the same indices
    moved = Join("c", 2, LAYOUT.to_json(), "m", base=2)
    assert "this head gave it [3, 4]" in join_refusal(moved, spec, LAYOUT, members)


def test_the_head_admits_what_fits_and_refuses_the_rest_saying_why() -> None:
    spec, members = _spec([2, 3]), {}
    assert join_refusal(_join(), spec, LAYOUT, members) == ""
    assert "serves 'other'" in join_refusal(_join(model="other"), spec, LAYOUT, members)
    bf16 = dataclasses.replace(LAYOUT, dtype="bfloat16")
    assert "dtype bfloat16" in join_refusal(_join(layout=bf16), spec, LAYOUT, members)
    heads = dataclasses.replace(LAYOUT, num_kv_heads=4)
    assert "num_kv_heads 4" in join_refusal(_join(layout=heads), spec, LAYOUT, members)
    more_blocks = dataclasses.replace(LAYOUT, num_blocks=999)  # pools may differ in size
    assert join_refusal(_join(layout=more_blocks), spec, LAYOUT, members) == ""
    assert "only 2 of" in join_refusal(_join(decode=3), spec, LAYOUT, members)
    members["b"] = Member("b", [2])
    assert join_refusal(_join(), spec, LAYOUT, members) == ""  # the same node, joining anew
    assert "joined before with 1" in join_refusal(_join(decode=2), spec, LAYOUT, members)
    assert "only 1 of" in join_refusal(_join(node="c", decode=2), spec, LAYOUT, members)
    assert "no decode worker" in join_refusal(_join(node="c", decode=0), spec, LAYOUT, members)
    # /health names each worker's node by the name it joined with: one that does not fit
    # a load-table row, or that is the head's, is refused.
    assert "at most 64" in join_refusal(_join(node="c" * 65), spec, LAYOUT, members)
    assert "the head's own" in join_refusal(_join(node="a"), spec, LAYOUT, members)


def test_a_member_holds_rings_only_with_a_local_end_and_its_gateway_the_remote_ones() -> None:
    shape = {"frontends": 1, "prefill": 2, "detok": 1, "decode": 3}
    mine = range(1, 2)
    topo = Topology(2, 3, 1, remote=cluster.member_remote(shape, mine))
    names = {str(n) for n in topo.rings}
    assert names == {
        "ctl.f0.d1",
        "kv.p0.d1",
        "kv.p1.d1",
        "rel.d1.p0",
        "rel.d1.p1",
        "tok.d1.k0",
        "stop.k0.d1",
    }
    gateway = topo.gateway_spec({})
    assert set(gateway.rings_in) == {"rel.d1.p0", "rel.d1.p1", "tok.d1.k0"}
    assert set(gateway.rings_out) == {"ctl.f0.d1", "kv.p0.d1", "kv.p1.d1", "stop.k0.d1"}
    decode = topo.spec(Role.DECODE, 1, {})
    assert set(decode.rings_in) == set(gateway.rings_out)
    assert decode.load_table["slot"] == 2 + 1  # the cluster's numbering: prefill rows first
    # A ring towards the gateway wakes the gateway, not a process that is not here.
    ring = topo.rings[RingName.parse("tok.d1.k0")]
    assert ring.spec.doorbell_fd == topo.doorbells[Topology.GATEWAY].fd


def test_a_head_relays_only_what_crosses_to_its_reserve() -> None:
    remote = frozenset({Peer(Role.DECODE, 1)})
    topo = Topology(1, 2, 1, remote=remote)
    gateway = topo.gateway_spec({})
    assert set(gateway.rings_in) == {"ctl.f0.d1", "kv.p0.d1", "stop.k0.d1"}
    assert set(gateway.rings_out) == {"rel.d1.p0", "tok.d1.k0"}
    local = {str(n) for n in topo.rings if n.kind is RingKind.KV}
    assert local == {"kv.p0.d0", "kv.p0.d1"}


def test_rows_cross_as_fields_and_are_mirrored_in_this_hosts_clock() -> None:
    n = 3
    table = LoadTable(bytearray(LoadTable.layout_nbytes(n)), n)
    w = table.writer(2)
    w.claim(Role.DECODE, 5, pid=123)
    w.publish(running_requests=4, free_kv_blocks=10, total_kv_blocks=64)
    w.set_state(WorkerState.READY)
    row = table.snapshot()[2]
    fields = row_fields(row)
    again = row_from_fields(2, dict(fields))
    assert again == row
    other = LoadTable(bytearray(LoadTable.layout_nbytes(n)), n)
    beat = time.monotonic_ns() - 1_000_000
    other.writer(1).mirror(again, beat, "b")
    mirrored = other.snapshot()[1]
    assert mirrored.pid == os.getpid() and mirrored.heartbeat_ns == beat and mirrored.node == "b"
    assert (mirrored.role, mirrored.index, mirrored.state) == (Role.DECODE, 5, WorkerState.READY)
    assert (mirrored.running_requests, mirrored.generation) == (4, row.generation)
    with pytest.raises(ValueError, match="missing"):
        row_from_fields(0, {"role": 2})


def test_without_the_nixl_extra_a_node_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("nixl", "nixl._api", "nixl_cu13", "nixl_cu12"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"pip install 'pdserve\[nixl\]'"):
        cluster.require_extra()
    # and launch says so before it starts anything
    argv = [*shlex.split("--prefill 0 --join 127.0.0.1:7481"), *KEY]
    assert main(argv) == 2


def test_the_head_names_a_members_rows_after_the_member_not_after_the_rows() -> None:
    n = 4  # one prefill row, then decode 0..2; the reserve is decode 1 and 2
    head = LoadTable(bytearray(LoadTable.layout_nbytes(n)), n)
    gateway = Gateway.__new__(Gateway)  # its row handling only: no process, no link
    gateway.cfg, gateway.table = _spec([1, 2]), head
    gateway.members = {"b0": Member("b0", [1]), "b1": Member("b1", [2])}
    member = LoadTable(bytearray(LoadTable.layout_nbytes(n)), n)
    w = member.writer(2)
    w.claim(Role.DECODE, 1, pid=7, node="what-b0-calls-itself")
    w.set_state(WorkerState.READY)
    fields = {**row_fields(member.snapshot()[2]), "age_ns": 0}
    assert gateway._on_rows(b"id-b0", Rows("b0", [dict(fields)])) is gateway.members["b0"]
    row = head.snapshot()[2]
    assert (row.role, row.index, row.state, row.node) == (Role.DECODE, 1, WorkerState.READY, "b0")
    # A row that names its node itself is a bad row, not a way to rename a worker.
    w.claim(Role.DECODE, 1, pid=8)
    forged = {**row_fields(member.snapshot()[2]), "age_ns": 0, "node": 0}
    gateway._on_rows(b"id-b0", Rows("b0", [forged]))
    assert head.snapshot()[2].generation == row.generation == 1  # the forged one was not
    assert head.snapshot()[2].node == "b0"
    # Nor may a member write another member's worker.
    gateway._on_rows(b"id-b1", Rows("b1", [dict(fields)]))
    assert head.snapshot()[2].node == "b0" and head.snapshot()[3].role is None


def test_engine_workers_are_told_the_interface_of_the_nodes_cluster_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """So UCX listens there only. The head's is its --advertise address's; a member's the
    one its packets to the head leave from; an operator's UCX_NET_DEVICES wins."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert cluster.interface_of("127.0.0.1") == "lo"
    assert cluster.interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here
    head = parse_args([*shlex.split("--advertise 127.0.0.1:7481 --remote-decode 1"), *KEY])
    member = parse_args([*shlex.split("--join 127.0.0.1:7481 --prefill 0"), *KEY])
    assert cluster.ucx_env(head) == cluster.ucx_env(member) == {"UCX_NET_DEVICES": "lo"}
    elsewhere = parse_args([*shlex.split("--advertise 192.0.2.77 --remote-decode 1"), *KEY])
    assert cluster.ucx_env(elsewhere) == {}  # and a warning saying to set it
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    assert cluster.ucx_env(head) == {}  # the children inherit the operator's choice


def test_the_rdma_ports_behind_an_interface_are_named_for_ucx(tmp_path: Path) -> None:
    """A RoCE NIC: its netdev links to its HCA, whose ports UCX names ``hca:port``."""
    (tmp_path / "class/net/eth1/device/infiniband/mlx5_0").mkdir(parents=True)
    for port in ("1", "2"):
        (tmp_path / "class/infiniband/mlx5_0/ports" / port).mkdir(parents=True)
    (tmp_path / "class/net/eth0").mkdir(parents=True)  # plain Ethernet
    assert cluster.rdma_ports("eth1", tmp_path) == ["mlx5_0:1", "mlx5_0:2"]
    assert cluster.rdma_ports("eth0", tmp_path) == []
    assert cluster.rdma_ports("nonexistent", tmp_path) == []
