"""The flags of admission and connections (``launch --help``: "Admission and
connections"): how many requests wait, how long a worker may stall, how long a client may
take, and how many connections it may hold."""

from __future__ import annotations

import argparse

from launcher.settings import ServerConfig


def add_admission_flags(g: argparse._ActionsContainer, d: ServerConfig) -> None:
    add = g.add_argument
    add(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="queued requests per worker beyond which new ones get HTTP 503 + Retry-After",
    )
    add(
        "--max-queued-prefill-tokens",
        type=int,
        default=d.max_queued_prefill_tokens,
        help="admission bound: prompt tokens queued on a prefill worker beyond which new "
        "requests get HTTP 503 + Retry-After (an idle worker still takes any prompt)",
    )
    add(
        "--stall-timeout",
        type=float,
        default=d.stall_timeout,
        help="seconds a READY worker may go without a heartbeat before its requests are "
        "resumed on other workers (it is reported stalled in /health after a quarter of it); "
        "a worker inside one step keeps its heartbeat for up to 60 s of it",
    )
    add(
        "--max-request-retries",
        type=int,
        default=d.max_request_retries,
        help="times a request is resumed after worker deaths blamed on it (it had just "
        "been given to the worker); at the next such death it ends with an error, as poison",
    )
    add(
        "--timeout-header",
        type=float,
        default=d.timeout_header,
        help="seconds a client has to send a whole request head (from connecting, or from "
        "the first byte of its next request); then 408 and closed",
    )
    add(
        "--timeout-body",
        type=float,
        default=d.timeout_body,
        help="seconds a client has to send a whole request body after its head; then 408 "
        "and closed",
    )
    add(
        "--timeout-keep-alive",
        type=float,
        default=d.timeout_keep_alive,
        help="seconds an idle kept-alive connection stays open between requests",
    )
    add(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="most client connections the frontend holds; beyond it new ones get 503 "
        "(0: the descriptor limit less a reserve that keeps /health answering)",
    )
    add(
        "--max-connections-per-peer",
        type=int,
        default=d.max_connections_per_peer,
        help="most connections one client address may hold; beyond it new ones get 503 "
        "(0: no cap; a reverse proxy on this host is one address)",
    )
