"""The HTTP edge of a real launched server: a body that arrives too late on Anthropic's
path gets a 408 that Anthropic's own SDK reads as an API error (its shape, its type, its
message), while OpenAI's paths keep OpenAI's shape; and a 6 MB body of unknown fields
writes a bounded line, not its field names, to the log."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest

from bundled_models import tiny
from tests.conftest import LaunchedServer

BODY_TIMEOUT_S = 3
MAX_LOG_BYTES = 8 << 10  # what one flooding request may add to the log


class LoggedServer(LaunchedServer):
    """``launch`` with its whole log (every process's) written to a file; stopped as any
    ``LaunchedServer`` is."""

    def __init__(self, log_path: Path, args: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "launcher.cli", "--port", str(self.port), *args]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while b"pdserve is serving" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(self.log_path.read_text()[-4000:])
            time.sleep(0.5)

    def log_size(self) -> int:
        return self.log_path.stat().st_size


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    log = tmp_path_factory.mktemp("edge") / "server.log"
    server = LoggedServer(
        log,
        [
            "--model",
            str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH)),
            "--colocated",
            "1",
            "--device",
            "cpu",
            "--served-model-name",
            "m",
            "--timeout-body",
            str(BODY_TIMEOUT_S),
        ],
    )
    server.wait_ready()
    try:
        yield server
    finally:
        server.stop()


def _exchange(port: int, head: bytes, body_part: bytes) -> bytes:
    """Send ``head`` and the first part of a body, never the rest: the server's reply."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body_part)
        sock.settimeout(BODY_TIMEOUT_S + 30)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


class LateBody(httpx2.BaseTransport):
    """A transport that sends a request's head and half its body over a raw socket, then
    stalls: whatever the server answers is handed to the SDK as the response."""

    def __init__(self, port: int) -> None:
        self.port = port

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        lines = [f"{request.method} {request.url.raw_path.decode()} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in request.headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        reply = _exchange(self.port, head, body[: len(body) // 2])
        status_line, _, rest = reply.partition(b"\r\n")
        raw_headers, _, content = rest.partition(b"\r\n\r\n")
        headers = [tuple(h.decode().split(": ", 1)) for h in raw_headers.split(b"\r\n")]
        return httpx2.Response(
            int(status_line.split()[1]), headers=headers, content=content, request=request
        )


def test_a_late_body_on_messages_is_a_408_the_anthropic_sdk_reads(srv: LoggedServer) -> None:
    client = anthropic.Anthropic(
        base_url=srv.url,
        api_key="unused",
        max_retries=0,  # the SDK retries a 408 by default
        http_client=httpx2.Client(transport=LateBody(srv.port)),
    )
    openai_reply: list[bytes] = []
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(chat)}\r\n\r\n"
    ).encode()
    other = threading.Thread(
        target=lambda: openai_reply.append(_exchange(srv.port, head, chat[:9]))
    )
    other.start()  # an OpenAI path's late body, at the same time
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    err = caught.value
    assert isinstance(err, anthropic.RequestTimeoutError) and err.status_code == 408
    assert err.type == "timeout_error"
    assert err.api_message == f"The request body was not received within {BODY_TIMEOUT_S} s"
    assert err.body == {
        "type": "error",
        "error": {"type": "timeout_error", "message": err.api_message},
    }
    other.join(BODY_TIMEOUT_S + 60)
    status, _, rest = openai_reply[0].partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408 "), openai_reply
    payload = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert "type" not in payload and payload["error"]["code"] == "request_timeout", payload


def _flood(path: str) -> dict[str, object]:
    """A valid request to ``path`` padded to ~6 MB with unknown top-level fields."""
    ask: dict[str, object] = {"model": "m", "max_tokens": 1, "temperature": 0}
    if path == "/v1/responses":
        ask = {"model": "m", "input": "Hi", "max_output_tokens": 16}
    else:
        ask["messages"] = [{"role": "user", "content": "Hi"}]
    fields = {f"unknown_field_{i:07d}": i for i in range(240_000)}  # ~25 bytes each
    return {**ask, **fields}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
def test_a_6mb_body_of_unknown_fields_writes_a_bounded_line_to_the_log(
    srv: LoggedServer, path: str
) -> None:
    body = json.dumps(_flood(path)).encode()
    assert 5_500_000 < len(body) < 8 << 20
    before = srv.log_size()
    r = httpx.post(
        srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=120
    )
    assert r.status_code == 200, r.text[:2000]
    # The frontend logs before it answers, so the file holds the request's lines by now.
    added = srv.log_size() - before
    assert added < MAX_LOG_BYTES, added
    text = srv.log_path.read_bytes()[before:].decode()
    line = next(ln for ln in text.splitlines() if "unknown fields" in ln)
    assert f"{path}: ignoring 240000 unknown fields: unknown_field_0000000" in line
    assert line.endswith("and 239995 more")
