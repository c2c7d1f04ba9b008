"""Who may call the API, and with what: Host, API key and Content-Type, before any route.

Pure ASGI and outermost, so that every path is covered, including the ones FastAPI adds
itself (/openapi.json) and the ones that do not exist (a 401 then, not a 404: without the
key nobody learns which paths do). Checked in this order, each a JSON error in OpenAI's
shape:

* Host (only without ``--api-key``): a DNS-rebinding defence. A web page the user visits
  can make the browser send requests to ``http://attacker.example:8000`` after pointing
  that name at 127.0.0.1; the browser then treats our answers as the attacker's origin and
  lets its script read them. Such a request carries ``Host: attacker.example``. Allowed:
  IP literals (a browser sends one only when the page itself was loaded from that address,
  which no attacker controls), ``localhost`` and ``*.localhost`` (browsers resolve those to
  loopback themselves), the name ``--host`` binds, and ``--allowed-hosts``. Else 421. A
  request with no Host header comes from no browser and passes.
* API key: with ``--api-key`` every path but /health (and /metrics with
  ``--metrics-no-auth``) needs ``Authorization: Bearer <key>``, or ``x-api-key: <key>``
  (how Anthropic's clients send it). Else 401.
* Content-Type: a POST to a JSON endpoint must say ``application/json``. A cross-site form
  or ``fetch`` can send ``text/plain`` (or no type) without the CORS preflight a JSON body
  needs, so this closes the remaining way for a page to make a keyless server generate.
  Else 415.

/health is exempt from all three: the accept thread answers most probes before they get
here, with no checks, and what it reports is no secret.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import APIError, MisdirectedRequest, Unauthorized, UnsupportedMediaType
from frontend.settings import FrontendSettings

JSON_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/tokenize",
        "/detokenize",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)


class Guard:
    def __init__(self, app: ASGIApp, settings: FrontendSettings) -> None:
        self.app = app
        key = settings.api_key
        self._auth = None if key is None else b"bearer " + key.encode()
        self._key = None if key is None else key.encode()
        self._open = {"/health"} | ({"/metrics"} if settings.metrics_no_auth else set())
        self._hosts: frozenset[str] | None = None  # None: any Host
        if key is None and "*" not in settings.allowed_hosts:
            names = {h.lower().rstrip(".") for h in settings.allowed_hosts}
            self._hosts = frozenset({*names, settings.host.lower().strip("[]")})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            error = self._check(scope)
            if error is not None:
                await error.response_for(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])  # later duplicates win; none of ours may repeat
        if self._hosts is not None and (host := headers.get(b"host")) is not None:
            name = host_name(host.decode("latin-1"))
            if not self._host_allowed(name):
                return MisdirectedRequest(name)
        needs_key = self._auth is not None and scope["path"] not in self._open
        if needs_key and not self._authorized(headers):
            return Unauthorized()
        if scope["method"] == "POST" and scope["path"] in JSON_PATHS:
            content_type = headers.get(b"content-type")
            if content_type is None or not is_json(content_type):
                got = None if content_type is None else content_type.decode("latin-1")
                return UnsupportedMediaType(got)
        return None

    def _host_allowed(self, name: str) -> bool:
        assert self._hosts is not None
        if name == "localhost" or name.endswith(".localhost") or name in self._hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self._auth is not None and self._key is not None
        value = headers.get(b"authorization", b"")
        # The scheme is case-insensitive ("Bearer", "bearer"); the key is not.
        bearer = hmac.compare_digest(value[:7].lower() + value[7:], self._auth)
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)


def host_name(host: str) -> str:
    """The name in a Host header: no port, no IPv6 brackets, lower case, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") <= 1 else host


def is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json"
