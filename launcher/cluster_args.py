"""The flags of a cluster of hosts and of logging (``launch --help``: "Several hosts and
logging"): the node's name, the head's advertised address, joining one, the shared key."""

from __future__ import annotations

import argparse

from launcher.settings import CLUSTER_KEY_ENV, DEFAULT_CLUSTER_PORT, LogLevel, ServerConfig
from transport.load_table import NODE_NBYTES


def add_cluster_flags(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
    add(
        "--node-name",
        default=d.node_name,
        help="this host's name in /health, /metrics and a cluster (default: its host "
        f"name); printable, at most {NODE_NBYTES} bytes of UTF-8",
    )
    add(
        "--advertise",
        default=d.advertise,
        metavar="HOST[:PORT]",
        help="serve as a cluster's head node: the address (and port, default "
        f"{DEFAULT_CLUSTER_PORT}) other nodes --join; the link listens on it only",
    )
    add(
        "--remote-decode",
        type=int,
        default=d.remote_decode,
        help="with --advertise: how many decode workers the joining nodes bring in all",
    )
    add(
        "--join",
        default=d.join,
        metavar="HOST:PORT",
        help="join the cluster whose head node advertises HOST:PORT, bringing this "
        "node's --decode workers (--prefill 0); needs pip install 'pdserve[nixl]'",
    )
    add(
        "--cluster-key",
        default=d.cluster_key,
        help=f"the secret every node of a cluster shares (or set {CLUSTER_KEY_ENV}); "
        "at least 16 characters",
    )
    add(
        "--log-level",
        type=LogLevel,
        choices=list(LogLevel),
        default=d.log_level,
        help="how much the server logs",
    )
