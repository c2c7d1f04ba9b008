"""POST /roles: set the roles of ``launch --workers`` workers by hand (tests, experiments).

Off unless the launch gave ``--allow-role-override``: then 404, as for a server without
``--workers``. Body ``{"roles": ["prefill", "decode", ...]}``, one role a worker by
index; answers 200 with the roles now, 400 when they cannot be served
(``frontend/engine_link/roles.py``). Setting roles by hand stops the planner for the life
of the server. Behind the API key like every path but /health (``guard.py``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.api.common.context import ServingContext
from frontend.engine_link.roles import RoleError
from frontend.errors import APIError


async def set_roles(ctx: ServingContext, request: Request) -> Response:
    """``POST /roles``: the body names one role a worker."""
    control = ctx.client.role_control
    if control is None or not control.allow_override:
        return APIError("Not Found", status=404).response()
    try:
        body = await request.json()
    except ValueError:
        return APIError('the body must be JSON: {"roles": [...]}', status=400).response()
    names = body.get("roles") if isinstance(body, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return APIError('give "roles": a list of role names', status=400).response()
    try:
        roles = control.set_by_hand(names)
    except RoleError as e:
        return APIError(str(e), status=400).response()
    return JSONResponse({"roles": [r.value for r in roles]})
