"""One interpreter that has imported torch and the children's modules, forked for each child.

Every child of a server used to be a fresh ``python -m <module>``: each imported torch and
the worker code on its own (about 1 s), and each held its own copy of what that import
writes, about 150 MiB a process of relocated library data and Python objects that never
change afterwards. The zygote imports them once; a child forked from it shares those pages
copy-on-write, so a host's tree holds them about once, and a restarted worker is up without
re-importing anything.

The launcher starts the zygote (``Zygote.start``) and asks it for each child with the
module to run, the child's whole environment and the fds its spec names (passed over a
Unix socket with ``SCM_RIGHTS``). The zygote forks twice: the intermediate process forks
the child and exits at once, so the child is re-parented to the launcher, which marks
itself a child subreaper (``PR_SET_CHILD_SUBREAPER``). The launcher is then the child's
parent, exactly as with ``subprocess.Popen``: it reaps it, reads its exit status, signals
it, and the child's ``PR_SET_PDEATHSIG`` (``runtime.process.bootstrap``) ties it to the
launcher, not to the zygote.

What a forked child must redo, because the zygote's import already happened:
- the fds: moved to the numbers its spec names, every other fd closed;
- the environment: replaced by the one the launcher sent;
- torch's thread count: libgomp read ``OMP_NUM_THREADS`` when the zygote loaded it (the
  zygote runs with 1, so that no thread pool exists to fork), so the child sets
  ``torch.set_num_threads`` from its own environment;
- the collector: the zygote froze its objects (``gc.freeze``) so that a child's
  collections do not write to the shared pages, and the child enables collection again.
Python re-seeds ``random`` in a forked child by itself. The zygote never runs a model, a
thread or CUDA, so there is nothing else to redo.

No pickle: requests and replies are JSON.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import importlib
import json
import os
import resource
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from runtime.process import (
    PARENT_ENV,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    prctl,
    set_title,
)

FD_ENV = "PDSERVE_ZYGOTE_FD"  # the zygote's end of its socket
MAX_FDS = 250  # one message's SCM_RIGHTS carries at most 253 fds (SCM_MAX_FD)
# Bytes of one request (a spec and an environment: tens of KB); a datagram must fit the
# socket's send buffer, 208 KiB by default (net.core.wmem_default).
MAX_MESSAGE = 192 * 1024
REPARENT_TIMEOUT_S = 10.0


class ZygoteError(RuntimeError):
    """The zygote could not start, or could not fork a child: start it fresh instead."""


class ZygoteRefused(ZygoteError):
    """This one child cannot go through the zygote (too many fds, too long a request);
    the zygote itself is fine."""


# -- the launcher's side ---------------------------------------------------------------


class ForkedChild:
    """A child the zygote forked and the launcher adopted: ``subprocess.Popen``'s surface
    that the supervisor uses (``pid``, ``returncode``, ``poll``, ``wait``, signals)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]
        deadline = None if timeout is None else time.monotonic() + timeout
        pidfd = os.pidfd_open(self.pid)  # not reaped yet: only poll() reaps it
        try:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
                select.select([pidfd], [], [], left)
        finally:
            os.close(pidfd)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Our child stays a zombie until we reap it, so its pid cannot name another process.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's handle on its zygote process."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock

    @classmethod
    def start(
        cls, modules: list[str], tokenizer: str | None = None, timeout_s: float = 120.0
    ) -> Zygote:
        """Start a zygote that imports ``modules`` (and loads the tokenizer of the model
        directory ``tokenizer``) and wait until it has.

        Marks the calling process a child subreaper, so the children it forks become ours.
        """
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {
            **os.environ,
            FD_ENV: str(theirs.fileno()),
            PARENT_ENV: str(os.getpid()),
            "OMP_NUM_THREADS": "1",  # no OpenMP or BLAS thread pool in the process we fork
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runtime.zygote",
                *(["--tokenizer", tokenizer] if tokenizer is not None else []),
                *modules,
            ],
            env=env,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        zygote = cls(proc, ours)
        try:
            reply = zygote._reply(timeout_s)
        except ZygoteError:
            zygote.close()
            raise
        if not reply.get("ready"):
            zygote.close()
            raise ZygoteError(f"zygote did not start: {reply.get('error', reply)}")
        return zygote

    def spawn(self, module: str, env: dict[str, str], fds: list[int]) -> ForkedChild:
        """Fork a child that runs ``python -m module`` with ``env`` and ``fds`` (same
        numbers as here). Raises ``ZygoteRefused`` for a request the zygote cannot take,
        ``ZygoteError`` when the zygote is gone or cannot fork."""
        if len(fds) > MAX_FDS:
            raise ZygoteRefused(f"{len(fds)} fds are more than one message carries")
        request = json.dumps({"module": module, "env": env, "fds": fds}).encode()
        if len(request) > MAX_MESSAGE:
            raise ZygoteRefused(f"a request of {len(request)} bytes is too long")
        # The child waits for a byte on this pipe before it runs anything: if we do not
        # learn its pid (no answer, a zygote that died), closing the pipe unwritten makes
        # it exit, so no child runs that the supervisor does not know of.
        go_read, go = os.pipe()
        try:
            try:
                socket.send_fds(self.sock, [request], [*fds, go_read])
            except OSError as e:
                if e.errno == errno.EMSGSIZE:
                    raise ZygoteRefused(f"a request of {len(request)} bytes is too long") from e
                raise ZygoteError(f"zygote gone: {e}") from e
            finally:
                os.close(go_read)
            reply = self._reply(30.0)
            if "pid" not in reply:
                raise ZygoteError(f"zygote could not fork: {reply.get('error', reply)}")
            child = ForkedChild(int(reply["pid"]))
            os.write(go, b"g")
            return child
        finally:
            os.close(go)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            raise ZygoteError(f"no answer from the zygote in {timeout_s:g} s")
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except OSError as e:
            raise ZygoteError(f"zygote gone: {e}") from e
        if not data:
            raise ZygoteError(f"zygote exited ({self.proc.poll()})")
        reply: dict[str, Any] = json.loads(data)
        return reply

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (it exits when its socket closes) and stop adopting orphans."""
        self.sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        prctl(PR_SET_CHILD_SUBREAPER, 0)


def reap_strays(known: set[int]) -> None:
    """Reap our zombie children that are not ``known`` (a dead child's own children, say):
    a subreaper inherits them, and nobody else waits for them."""
    try:
        kids: set[int] = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                kids.update(int(pid) for pid in f.read().split())
    except OSError:
        return
    for pid in kids - known:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            if zombie:
                os.waitpid(pid, os.WNOHANG)


# -- the zygote's side -----------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """What a forked child runs once it has left the zygote's loop."""

    module: str
    env: dict[str, str]


def _serve(sock: socket.socket, launcher: int) -> _Job:
    """Fork a child for each request until the launcher closes the socket (then exit).
    Returns only in a forked child."""
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS + 1)
        if not data:
            os._exit(0)
        try:
            request = json.loads(data)
            job = _Job(str(request["module"]), {str(k): str(v) for k, v in request["env"].items()})
            targets = [int(fd) for fd in request["fds"]]
            if len(targets) + 1 != len(fds):  # the last one is the go pipe
                raise ValueError(f"{len(targets)} fd numbers for {len(fds)} fds")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            for fd in fds:
                os.close(fd)
            _answer(sock, {"error": f"bad request: {e}"})
            continue
        pid = _fork_adoptable(sock, fds, targets, launcher)
        if pid is None:  # the child
            return job
        for fd in fds:
            os.close(fd)
        _answer(sock, {"pid": pid} if pid > 0 else {"error": "fork failed"})


def _answer(sock: socket.socket, reply: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(reply).encode())
    except OSError:  # the launcher is gone: so are we
        os._exit(0)


def _fork_adoptable(
    sock: socket.socket, fds: list[int], targets: list[int], launcher: int
) -> int | None:
    """Fork twice so the child's parent becomes the launcher (a subreaper). Returns the
    child's pid in the zygote (-1 if a fork failed) and None in the child."""
    sys.stdout.flush()  # nothing buffered here may be written again by the children
    sys.stderr.flush()
    r, w = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return -1
    if middle == 0:  # the intermediate process: fork the child, say its pid, leave
        os.close(r)
        middle_pid = os.getpid()
        try:
            child = os.fork()
        except OSError:
            os._exit(1)
        if child == 0:
            os.close(w)
            _become_child(sock, fds, targets, middle_pid, launcher)
            return None
        os.write(w, str(child).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)
    return int(text) if text else -1


def _become_child(
    sock: socket.socket, fds: list[int], targets: list[int], middle: int, launcher: int
) -> None:
    """In the forked child: wait to be the launcher's and for its go, then take on the
    fds it was sent (``fds[-1]`` is the go pipe)."""
    sock.close()
    set_title("pdserve:starting")  # not the zygote's: the child's own comes with its spec
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.001)
    if os.getppid() != launcher:  # the launcher died meanwhile
        os._exit(1)
    *fds, go = fds
    if os.read(go, 1) != b"g":  # the launcher never learnt our pid: leave
        os._exit(1)
    os.close(go)
    _move_fds(fds, targets)
    keep = sorted({0, 1, 2, *targets})
    for lo, hi in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
        os.closerange(lo + 1, hi)


def _move_fds(fds: list[int], targets: list[int]) -> None:
    """Put ``fds[i]`` at ``targets[i]``, through numbers above every target so that none
    is clobbered; the fd limit is raised for the move if that needs it, then restored."""
    floor = max([*targets, *fds, 2]) + 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = floor + len(fds) + 1
    if need > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    if need > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _run(job: _Job) -> None:
    """Run the child's module as ``python -m`` would, in this (forked) interpreter."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(job.env)
    gc.enable()
    threads = job.env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = [job.module]
    # The zygote imported it by name; run it afresh as __main__, as ``python -m`` would.
    sys.modules.pop(job.module, None)
    runpy.run_module(job.module, run_name="__main__", alter_sys=True)


def _preload_tokenizer(model_dir: str) -> None:
    """The children's tokenizer, loaded once here (``engine.tokenizer.hf_tokenizer``):
    a failure only costs each child its own load, so it is said and not fatal."""
    from engine.tokenizer.hf_tokenizer import preload_tokenizer

    try:
        preload_tokenizer(model_dir)
    except Exception as e:  # whatever it was, the children load their own
        print(f"pdserve:zygote: tokenizer of {model_dir} not preloaded: {e!r}", file=sys.stderr)


def _unsafe_to_fork() -> str | None:
    """Why a child forked from here would not be sound, or None: only the calling thread
    survives a fork (a lock another thread held stays held), and a CUDA context does not
    survive it at all. An import that started either is caught here, not in the children."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"importing the children's modules started {threads - 1} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "importing the children's modules initialised CUDA"
    return None


def main() -> None:
    gc.disable()  # no collections while importing: they would leave holes in shared pages
    sock = socket.socket(fileno=int(os.environ.pop(FD_ENV)))
    launcher = int(os.environ[PARENT_ENV])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    set_title("pdserve:zygote")
    # python -m runtime.zygote [--tokenizer MODEL_DIR] MODULE...
    modules, tokenizer = sys.argv[1:], None
    if modules[:1] == ["--tokenizer"]:
        tokenizer, modules = modules[1], modules[2:]
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # said to the launcher, which then starts fresh interpreters
            sock.send(json.dumps({"error": f"importing {module}: {e!r}"}).encode())
            os._exit(1)
    if tokenizer is not None:
        _preload_tokenizer(tokenizer)
    unsafe = _unsafe_to_fork()
    if unsafe:
        _answer(sock, {"error": unsafe})
        os._exit(1)
    gc.freeze()
    _answer(sock, {"ready": True})
    job = _serve(sock, launcher)
    _run(job)


if __name__ == "__main__":
    main()
