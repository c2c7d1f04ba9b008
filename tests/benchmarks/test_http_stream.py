"""The benchmark client's transport (``benchmarks/harness/http_stream.py``) against raw
responses from a loopback server: each body framing, lines split anywhere, refusals."""

from __future__ import annotations

import asyncio
import socket

import pytest

from benchmarks.harness.http_stream import ConnectError, HttpError, post_lines

EVENTS = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'
WANT = [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", b"data: [DONE]", b""]


def _chunked(body: bytes, cuts: list[int]) -> bytes:
    out, at = b"", 0
    for cut in [*cuts, len(body)]:
        piece = body[at:cut]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        at = cut
    return out + b"0\r\n\r\n"


async def _exchange(response: bytes) -> tuple[list[bytes], bytes]:
    """Serve ``response`` (in pieces, with pauses) to one request; -> the lines
    ``post_lines`` yields and the request the server read."""
    seen = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.extend(head + await reader.readexactly(length))
        for at in range(0, len(response), 7):  # pieces that cut lines and chunk sizes
            writer.write(response[at : at + 7])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        body = b'{"prompt": "x"}'
        got = [line async for line in post_lines(f"http://127.0.0.1:{port}/v1/x", body, {"K": "v"})]
    finally:
        server.close()
    return got, bytes(seen)


@pytest.mark.parametrize(
    "framing",
    [
        b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(EVENTS, [3, 17, 18, 40]),
        f"Content-Length: {len(EVENTS)}\r\n\r\n".encode() + EVENTS,
        b"Connection: close\r\n\r\n" + EVENTS,  # the body ends with the connection
    ],
    ids=["chunked", "length", "close"],
)
def test_every_framing_yields_the_same_lines(framing: bytes) -> None:
    got, request = asyncio.run(_exchange(b"HTTP/1.1 200 OK\r\nX-A: b\r\n" + framing))
    assert got == WANT
    assert request.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"\r\nK: v\r\n" in request and request.endswith(b'\r\n\r\n{"prompt": "x"}')


def test_a_refusal_raises_with_its_status_and_body() -> None:
    body = b'{"error": {"message": "no such model"}}'
    response = b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with pytest.raises(HttpError) as e:
        asyncio.run(_exchange(response))
    assert e.value.status == 404 and "no such model" in str(e.value)


def test_a_body_cut_short_is_an_error_not_a_short_answer() -> None:
    with pytest.raises(ConnectionError, match="short"):
        asyncio.run(_exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n" + EVENTS))


def test_a_port_nobody_listens_on_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def lines() -> list[bytes]:
        return [line async for line in post_lines(f"http://127.0.0.1:{port}/", b"{}")]

    with pytest.raises(ConnectError):
        asyncio.run(lines())
