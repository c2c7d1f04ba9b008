"""One streamed HTTP/1.1 POST on asyncio's own streams: the benchmark client's transport.

Why not httpx (the client before this one): on the two-core machines the benchmarks run on,
the client shares the cores with the server it measures, and httpx's streaming path
(its transports, h11's parser and the line decoder above them) cost 200-370 us of CPU a
streamed token there, taken from the server's cores mid-step. This reads the response with
``StreamReader.readline`` and ``readexactly`` and splits lines itself; every server, ours
and the peers, is measured through it alike. One connection a request (``Connection:
close``): a request's cost does not depend on which came before it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 30.0


class ConnectError(ConnectionError):
    """The server could not be reached."""


class HttpError(RuntimeError):
    """A response other than 200, with its body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status, self.body = status, body


async def post_lines(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> AsyncGenerator[bytes, None]:
    """POST ``body`` (JSON) to ``url``; yield the 200 response body's lines as they arrive,
    without their line ends. Raises ``ConnectError`` or ``HttpError``. The caller bounds
    the whole exchange (``asyncio.wait_for``); closing the iterator closes the connection."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"not an http:// URL: {url}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port or 80), CONNECT_TIMEOUT_S
        )
    except (OSError, TimeoutError) as e:
        raise ConnectError(f"{parts.netloc}: {e or type(e).__name__}") from e
    try:
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {parts.netloc}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Accept: text/event-stream",
            "Connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        status, fields = await _head(reader)
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        length = int(fields["content-length"]) if "content-length" in fields else None
        if status != 200:
            raw = b"".join([piece async for piece in _body(reader, chunked, length)])
            raise HttpError(status, raw.decode(errors="replace"))
        carry = b""
        async for piece in _body(reader, chunked, length):
            *done, carry = (carry + piece).split(b"\n")
            for line in done:
                yield line.rstrip(b"\r")
        if carry:
            yield carry.rstrip(b"\r")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the header fields (names lower-cased) of a response."""
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
    fields: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        fields[name.strip().lower()] = value.strip()
    return int(parts[1]), fields


async def _body(
    reader: asyncio.StreamReader, chunked: bool, length: int | None
) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive: chunk by chunk, ``length`` bytes, or to the end."""
    if chunked:
        while True:
            size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readline()  # the chunk's CRLF
    left = length
    while left is None or left > 0:
        piece = await reader.read(1 << 16 if left is None else min(left, 1 << 16))
        if not piece:
            if left:
                raise ConnectionError(f"the body ended {left} bytes short")
            return
        if left is not None:
            left -= len(piece)
        yield piece
