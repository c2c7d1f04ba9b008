"""/health: the workers' liveness and load, and whether the server can serve. Answered
by the accept thread's fast path (``frontend/http/server.py``) and, when that is bypassed,
by the app's route table (``frontend/http/routes.py``)."""

from __future__ import annotations

import logging
from dataclasses import asdict

import msgspec
from starlette.responses import Response

from frontend.engine_link.engine_client import EngineClient, WorkerHealth
from frontend.errors import InternalError

logger = logging.getLogger(__name__)


def node_summary(workers: list[WorkerHealth]) -> dict[str, dict[str, int]]:
    """/health's ``"nodes"``: per node name (sorted), how many of the processes /health
    lists run there and how many of those are alive."""
    out: dict[str, dict[str, int]] = {}
    for w in sorted(workers, key=lambda w: w.node):
        counts = out.setdefault(w.node, {"workers": 0, "alive": 0})
        counts["workers"] += 1
        counts["alive"] += w.alive
    return out


def health_report(client: EngineClient, deterministic: bool = False) -> tuple[int, bytes]:
    """(status, JSON body) of /health.

    200 while every role has a live worker: ``"ok"`` when all are alive, ``"degraded"``
    when some are not (each worker's state and, for a dead one, how it died, say which).
    503 ``"unavailable"`` when some role has no live worker: nothing can be served.
    Each worker names its node; ``"nodes"`` counts the workers and live ones per node.
    ``"deterministic"``: whether the workers serve batch-invariant
    (``engine/model/batch_invariance.py``).
    """
    try:
        workers = client.health()
    except Exception:
        logger.exception("engine health check failed")
        err = InternalError("engine health check failed")
        return err.status, msgspec.json.encode(err.body())
    roles: dict[str, bool] = {}
    for w in workers:
        roles[w.role] = roles.get(w.role, False) or w.alive
    serving = all(roles.values())
    status = ("ok" if all(w.alive for w in workers) else "degraded") if serving else "unavailable"
    body = {
        "status": status,
        "workers": [asdict(w) for w in workers],
        "nodes": node_summary(workers),
        "deterministic": deterministic,
    }
    return 200 if serving else 503, msgspec.json.encode(body)


def health_response(client: EngineClient, deterministic: bool = False) -> Response:
    status, body = health_report(client, deterministic)
    return Response(body, status_code=status, media_type="application/json")
