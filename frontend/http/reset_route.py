"""POST /reset_prefix_cache (vLLM's name): every pool and KV tier forgets every prefix.

Behind the API key like every path but /health (``guard.py``). No body. Answers 200 once
every engine worker of this node has forgotten its pool's prefixes and the host tiers
are empty (``frontend/engine_link/prefix_reset.py``), with what was done; 503 when a
worker or tier 3's writer did not confirm in time (the reset may then be partial: send it
again); 501 from an engine client that cannot reset.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.api.common.context import ServingContext
from frontend.engine_link.engine_client import EngineUnavailable
from frontend.engine_link.prefix_reset import ResetDone, ResetTimeout
from frontend.errors import APIError

logger = logging.getLogger(__name__)


async def reset_prefix_cache(ctx: ServingContext, request: Request) -> Response:
    """``POST /reset_prefix_cache``; no body."""
    client = ctx.client
    try:
        done = await client.reset_prefix_cache()
    except NotImplementedError as e:
        return APIError(str(e), status=501).response()
    except (ResetTimeout, EngineUnavailable) as e:
        logger.warning("prefix cache reset incomplete: %s", e)
        return APIError(f"prefix cache reset incomplete: {e}", status=503).response()
    assert isinstance(done, ResetDone)
    logger.info("prefix caches reset: %s", done)
    return JSONResponse(
        {
            "reset": True,
            "workers": done.workers,
            "host_blocks_dropped": done.host_blocks,
            "disk_cleared": done.disk_cleared,
        }
    )
