"""The frontend process: ``python -m frontend.http.server`` (started by the launcher).

Builds the tokenizer, the ring engine client and the FastAPI app, then serves HTTP with
uvicorn on the configured host and port. The listening socket itself belongs to the C
accept thread of ``frontend.http.acceptor``: it answers health probes off the event loop and
hands every other connection to uvicorn, through ``frontend.http.connections``' protocol
(deadlines for slow clients, caps on connections).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from engine.tokenizer.hf_tokenizer import load_tokenizer
from frontend.engine_link.client_rings import RingEngineClient
from frontend.engine_link.engine_client import EngineClient
from frontend.http.acceptor import HealthAcceptor
from frontend.http.app import build_app
from frontend.http.connections import (
    ConnectionLimiter,
    TimedHttpProtocol,
    connection_budget,
    fds_open,
    raise_fd_limit,
)
from frontend.http.health import health_report
from frontend.settings import ConnectionLimits, FrontendLaunch
from frontend.telemetry.metrics import FrontendMetrics
from router.router import RouterConfig
from runtime.process import bootstrap
from runtime.strict_spec import exit_on_bad_spec
from transport.load_table import WorkerState

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn, minus its own listener: connections arrive from the accept thread."""

    def __init__(
        self,
        config: uvicorn.Config,
        sock: socket.socket,
        client: EngineClient,
        metrics: FrontendMetrics,
        limits: ConnectionLimits,
        deterministic: bool = False,
    ) -> None:
        super().__init__(config)
        self.sock, self.client, self.metrics, self.limits = sock, client, metrics, limits
        self.deterministic = deterministic  # reported by /health
        self.acceptor: HealthAcceptor | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # lifespan and state; no listener
        if self.should_exit:
            return

        # Counted now, with everything but connections open: what is left is theirs.
        budget = connection_budget(raise_fd_limit(), fds_open())
        limiter = ConnectionLimiter(
            self.limits.max_connections or budget, self.limits.max_connections_per_peer
        )
        logger.info(
            "at most %d connections (%s per client address)",
            limiter.max_connections,
            limiter.max_per_peer or "no cap",
        )
        self.metrics.add_connections(limiter.stats)

        def protocol() -> asyncio.Protocol:
            return TimedHttpProtocol(
                config=self.config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                limits=self.limits,
                limiter=limiter,
            )

        self.acceptor = HealthAcceptor(
            self.sock, protocol, lambda: health_report(self.client, self.deterministic)
        )
        if self.client.board is not None:  # before the first report the acceptor publishes
            self.client.board.set_state(WorkerState.READY)
        self.acceptor.start()
        self.metrics.add_acceptor(self.acceptor.stats)
        host, port = self.sock.getsockname()[:2]
        logger.info("serving HTTP on %s:%d", host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.client.board is not None:
            self.client.board.set_state(WorkerState.DRAINING)
        if self.acceptor is not None:
            self.acceptor.close()  # first stop taking new connections
            await self.acceptor.wait_adopted()  # so that uvicorn's sweep below sees them all
        await super().shutdown(sockets)


def main() -> None:
    spec, _ = bootstrap()
    launch = exit_on_bad_spec(spec.settings, FrontendLaunch)
    tokenizer = load_tokenizer(launch.model)
    settings, limits = launch.http, launch.connections
    router_config = RouterConfig(
        max_waiting_requests=launch.max_waiting_requests,
        max_queued_prefill_tokens=launch.max_queued_prefill_tokens,
        stale_after_s=launch.stall_timeout_s / 4,  # when /health starts to call it stalled
        max_loras=max(1, settings.max_loras),
    )
    client = RingEngineClient(
        spec,
        launch.router_policy,
        router_config,
        launch.stall_timeout_s,
        node=launch.node,
        remote_decode=launch.remote_decode,
        slo_ms=launch.slo_ms,
        allow_role_override=launch.allow_role_override,
        max_request_retries=launch.max_request_retries,
    )
    app = build_app(client, tokenizer, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=launch.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float is fine
    )
    # Bound here, before the model-sized work is done, so a taken port fails fast; backlog
    # as uvicorn's default, enough for a burst of thousands of clients. SO_REUSEPORT only
    # with several frontends: it would let another process of this user share the port.
    sock = socket.create_server(
        (settings.host, settings.port), backlog=2048, reuse_port=launch.api_workers > 1
    )
    _Server(config, sock, client, app.state.ctx.metrics, limits, settings.deterministic).run()


if __name__ == "__main__":
    main()
