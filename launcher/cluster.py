"""The launcher's part in a cluster of hosts (``docs/multi_host.md``): what the head node
reserves for the decode workers other nodes bring, how a member joins, and each node's
gateway process (``cluster/gateway.py``).

Membership is static: the head is told how many decode workers will join
(``--remote-decode``) and numbers them after its own; a member asks for rows and rings
for its ``--decode`` workers with ``Join`` and is told its first index and the cluster's
shape, or refused with the reason (another model, another KV layout, no room left, a
wrong ``--cluster-key``). Everything crosses on the authenticated cluster link.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

from cluster.membership import GatewaySpec
from launcher.args import check_node_name, split_host_port
from launcher.settings import DEFAULT_CLUSTER_PORT, ConfigError, ServerConfig
from launcher.supervisor import Child
from launcher.topology import Topology
from runtime.strict_spec import encode_spec
from transport.errors import ClusterUnavailable, LinkError
from wire.kv_layout import KVLayout
from wire.ring_names import Peer
from wire.roles import Role

logger = logging.getLogger("launch")

JOIN_TIMEOUT_S = 30.0
BEAT_S = 0.2


def node_name(config: ServerConfig) -> str:
    """``--node-name`` (checked by ``parse_args``), or the host name, checked here: a host
    name that cannot name a node in the load table asks for ``--node-name``."""
    if config.node_name is not None:
        return config.node_name
    host = socket.gethostname()
    try:
        check_node_name(host, "the host name")
    except ConfigError as e:
        raise ConfigError(f"{e}; give --node-name") from e
    return host


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


def interface_of(addr: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``addr``, or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def rdma_ports(interface: str, sysfs: Path = Path("/sys")) -> list[str]:
    """The RDMA ports (``mlx5_0:1``) of the NIC behind ``interface`` (RoCE, or the HCA
    of an IPoIB interface), as ``UCX_NET_DEVICES`` names them; none on plain Ethernet."""
    hcas = sysfs / "class" / "net" / interface / "device" / "infiniband"
    out = []
    for hca in sorted(hcas.iterdir()) if hcas.is_dir() else []:
        ports = sysfs / "class" / "infiniband" / hca.name / "ports"
        numbers = sorted(int(p.name) for p in ports.iterdir()) if ports.is_dir() else []
        out += [f"{hca.name}:{n}" for n in numbers]
    return out


def local_address(config: ServerConfig) -> str | None:
    """This node's address on the cluster's network: the head's ``--advertise``d one; on a
    member, the one its packets to the head leave from (a UDP connect sends nothing)."""
    try:
        if config.advertise is not None:
            host, _ = split_host_port(config.advertise, "--advertise", DEFAULT_CLUSTER_PORT)
            return socket.gethostbyname(host)
        host, port = split_host_port(config.join or "", "--join")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return str(s.getsockname()[0])
    except OSError:
        return None


def ucx_env(config: ServerConfig) -> dict[str, str]:
    """``UCX_NET_DEVICES`` for this node's engine workers: the interface of its cluster
    address and the RDMA ports of its NIC, so their NIXL agents (UCX) listen there only,
    not on every interface, and still read over RDMA where the NIC has it. An operator's
    own ``UCX_NET_DEVICES`` wins (e.g. an RDMA NIC beside the control network)."""
    if "UCX_NET_DEVICES" in os.environ:
        return {}
    addr = local_address(config)
    name = interface_of(addr) if addr else None
    if name is None:
        logger.warning(
            "no interface holds this node's cluster address %s: UCX may listen on "
            "every interface; set UCX_NET_DEVICES to choose",
            addr,
        )
        return {}
    devices = ",".join([name, *rdma_ports(name)])
    logger.info(
        "KV across hosts (NIXL over UCX) on interface %s (%s): UCX_NET_DEVICES=%s",
        name,
        addr,
        devices,
    )
    return {"UCX_NET_DEVICES": devices}


def require_extra() -> None:
    """Fail at once, naming the extra, when this install cannot join a cluster."""
    try:
        from transport.link.auth import cluster_keypair
        from transport.nixl_agent import load_nixl

        load_nixl()
        cluster_keypair("x" * 16)
    except ClusterUnavailable as e:
        raise ConfigError(str(e)) from e


def remote_decode(config: ServerConfig) -> list[int]:
    """The head's reserve: decode indices after its own, for the workers that join."""
    return list(range(config.decode, config.decode + config.remote_decode))


def head_topology_remote(config: ServerConfig) -> frozenset[Peer]:
    return frozenset(Peer(Role.DECODE, j) for j in remote_decode(config))


def member_remote(shape: dict[str, int], mine: range) -> frozenset[Peer]:
    """On a member, every peer but its own decode workers lives on another host."""
    peers = [Peer(Role.FRONTEND, n) for n in range(shape["frontends"])]
    peers += [Peer(Role.PREFILL, i) for i in range(shape["prefill"])]
    peers += [Peer(Role.DETOK, k) for k in range(shape["detok"])]
    peers += [Peer(Role.DECODE, j) for j in range(shape["decode"]) if j not in mine]
    return frozenset(peers)


def silent_after(config: ServerConfig) -> float:
    """How long a silent node's workers stay routable: under the frontends' stall timeout,
    so recovery moves their requests rather than waiting on rows that look alive."""
    return max(1.0, min(5.0, config.stall_timeout / 2))


def head_gateway(config: ServerConfig, topo: Topology, layout: KVLayout, model_name: str) -> Child:
    host, port = split_host_port(config.advertise or "", "--advertise", DEFAULT_CLUSTER_PORT)
    shape = {"frontends": topo.f, "prefill": topo.p, "detok": topo.k, "decode": topo.d}
    spec = GatewaySpec(
        log_level=config.log_level.value,
        node=node_name(config),
        cluster_key=config.cluster_key or "",
        listen=f"{host}:{port}",
        join="",
        num_prefill=topo.p,
        decode=remote_decode(config),
        shape=json.dumps(shape),
        layout=layout.to_json(),
        model=model_name,
        beat_s=BEAT_S,
        silent_after_s=silent_after(config),
    )
    return Child(topo.gateway_spec(encode_spec(spec)), {"CUDA_VISIBLE_DEVICES": ""})


def member_gateway(
    config: ServerConfig, topo: Topology, layout: KVLayout, model_name: str, mine: range
) -> Child:
    spec = GatewaySpec(
        log_level=config.log_level.value,
        node=node_name(config),
        cluster_key=config.cluster_key or "",
        listen="",
        join=config.join or "",
        num_prefill=topo.p,
        decode=list(mine),
        shape="",
        layout=layout.to_json(),
        model=model_name,
        beat_s=BEAT_S,
        silent_after_s=silent_after(config),
    )
    return Child(topo.gateway_spec(encode_spec(spec)), {"CUDA_VISIBLE_DEVICES": ""})


def join(config: ServerConfig, layout: KVLayout, model_name: str) -> tuple[int, dict[str, int]]:
    """Ask the head for this node's decode indices: (first index, the cluster's shape)."""
    from transport.link.client import LinkClient
    from wire.link_records import Join, Welcome

    assert config.join is not None and config.cluster_key is not None
    node = node_name(config)
    try:
        with LinkClient(config.join, config.cluster_key, node) as client:
            client.connect(JOIN_TIMEOUT_S)
            client.send_link(Join(node, config.decode, layout.to_json(), model_name))
            answer = client.recv(JOIN_TIMEOUT_S)
    except LinkError as e:
        raise ConfigError(f"--join {config.join}: {e}") from e
    if not isinstance(answer, Welcome):
        raise ConfigError(f"--join {config.join}: the head did not answer the join")
    if answer.refused:
        raise ConfigError(f"--join {config.join}: the head refused this node: {answer.refused}")
    shape = json.loads(answer.shape)
    return answer.base, {k: int(v) for k, v in shape.items()}
