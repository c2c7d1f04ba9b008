"""Session-wide fixtures: the Qwen2-vocabulary tokenizer and the tiny checkpoints.

They are built offline on first use and cached (see ``bundled_models.tiny``), so the
suite needs no network and pays the build cost once per machine.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from bundled_models import tiny


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    return tiny.tokenizer_dir()


@pytest.fixture(scope="session")
def qwen_tokenizer(tokenizer_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


@pytest.fixture(scope="session", params=tiny.ARCHITECTURES)
def tiny_model_path(request: pytest.FixtureRequest) -> Path:
    """Each tiny architecture in turn (llama, qwen2, qwen3)."""
    return tiny.tiny_model_dir(request.param)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return tiny.tiny_model_dir(tiny.DEFAULT_ARCH)


class LaunchedServer:
    """A real ``launch`` process tree on a free loopback port.

    It serves the tiny random Qwen2 model unless ``args`` name a ``--model`` or
    ``tiny_model=False`` (then ``launch``'s own default): the suite checks serving mechanics
    against transformers, and stays fast, on the tiny model.
    """

    def __init__(self, args: list[str], tiny_model: bool = True) -> None:
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if tiny_model and "--model" not in args:
            args = ["--model", str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH)), *args]
        cmd = [sys.executable, "-m", "launcher.cli", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.log: list[str] = []

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import threading
        import time

        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if "pdserve is serving" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("launch did not become ready:\n" + "".join(self.log[-40:]))

    @classmethod
    def serving(cls, args: str | list[str], tiny_model: bool = True) -> Iterator[LaunchedServer]:
        """A module fixture's body: ``yield from LaunchedServer.serving("--prefill 1 ...")``
        (``args`` one shell-quoted string, or the list of arguments), stopped after."""
        srv = cls(shlex.split(args) if isinstance(args, str) else args, tiny_model)
        srv.wait_ready()
        try:
            yield srv
        finally:
            srv.stop()

    def health(self) -> dict:  # type: ignore[type-arg]
        import httpx

        return httpx.get(self.url + "/health", timeout=5).json()  # type: ignore[no-any-return]

    def stop(self) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(default_model_path: Path):  # type: ignore[no-untyped-def]
    """One shared disaggregated server: 2 prefill, 2 decode, 2 detokenizer shards, CPU."""
    yield from LaunchedServer.serving(
        "--prefill 2 --decode 2 --detokenizers 2 --device cpu --kv-cache-tokens 16384 --max-model-len 1024"
    )
