"""The frontend's grammar check: does a request's grammar compile, within its budget?

Who calls what, when:
- ``check(spec)`` as a constrained request arrives (``frontend/api/common/structured.py``):
  a verdict cached by ``spec.key`` answers at once (``hits`` counts it); otherwise the
  spec goes to an idle worker process (``grammar_worker.py``), and the verdict, once in,
  is cached (LRU, ``max_cached`` entries). Raises ``GrammarError`` if the grammar does
  not compile, ``GrammarTimeout`` if it outlasts ``timeout_s``.
- the first worker starts with the first grammar to check (``start()``, from ``check``):
  a worker holds the grammar library and the vocabulary, about 200 MiB, which a server
  that never sees a constrained request should not pay (per frontend process). That
  first request waits for the worker to load (1.3 s on an idle 2-core host), outside
  its compile budget.
- ``close()`` at shutdown.

Invariants: compiles run in worker processes, never on the event loop nor in its
process, so a heavy schema costs the frontend nothing but a wait. A compile that
outlasts the budget is abandoned by killing its worker (a compile cannot be stopped from
inside); a fresh worker replaces it in the background. At most ``workers`` compiles run
at once; more wait, first come first served, and the budget counts only the compile.
A compile runs to its verdict even if the client that asked leaves: the verdict is
cached and the worker goes back whole. Timeouts are cached like any verdict: a client
repeating a schema that timed out costs nothing the second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from engine.sampling.grammar import GrammarError
from frontend.engine_link.grammar_worker import HEADER, WorkerConfig
from wire.params import GrammarSpec

logger = logging.getLogger(__name__)

MAX_CACHED_VERDICTS = 256
STARTUP_TIMEOUT_S = 120.0  # importing the grammar library and loading a vocabulary
_EXIT_WAIT_S = 5.0  # a worker that failed and closed its pipe, to exit with its own status


class GrammarTimeout(Exception):
    """A grammar that did not compile within the budget; its compile was abandoned."""


class GrammarUnavailable(Exception):
    """No worker could compile: a fault of the server, not of the request."""


class _Reply(msgspec.Struct):
    id: int = -1
    ok: bool = False
    error: str | None = None
    ready: bool = False


class _Worker:
    """One compile process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.jobs = 0

    async def read(self) -> _Reply:
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(HEADER.size)
        payload = await self.proc.stdout.readexactly(HEADER.unpack(head)[0])
        return msgspec.json.decode(payload, type=_Reply)

    async def compile(self, spec: GrammarSpec) -> _Reply:
        assert self.proc.stdin is not None
        self.jobs += 1
        payload = msgspec.json.encode({"id": self.jobs, "kind": spec.kind, "text": spec.text})
        self.proc.stdin.write(HEADER.pack(len(payload)) + payload)
        await self.proc.stdin.drain()
        reply = await self.read()
        if reply.id != self.jobs:
            raise ConnectionError(f"grammar worker answered job {reply.id}, not {self.jobs}")
        return reply

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


def _why(e: Exception, worker: _Worker | None) -> str:
    """What a failed start says: its exit status where it died, else the error."""
    code = None if worker is None else worker.proc.returncode
    if isinstance(e, asyncio.IncompleteReadError) and code is not None:
        return f"it exited with status {code} (see the server log)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# A verdict: None (compiles), or the error to raise, as its type and message: a fresh
# exception each time (one raised again and again would grow its traceback each time).
Verdict = tuple[type[GrammarError | GrammarTimeout], str] | None


class GrammarPool:
    """Grammar verdicts by spec key, from up to ``workers`` compile processes."""

    def __init__(
        self,
        config: WorkerConfig,
        timeout_s: float,
        workers: int = 2,
        max_cached: int = MAX_CACHED_VERDICTS,
        on_compile: Callable[[], None] | None = None,
        on_hit: Callable[[], None] | None = None,
    ) -> None:
        self.config, self.timeout_s, self.max_workers = config, timeout_s, workers
        self._max_cached = max_cached
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()  # LRU first
        self._running: dict[str, asyncio.Task[Verdict]] = {}
        self._idle: asyncio.Queue[_Worker] | None = None
        # Resolved, with why, when a start fails and no worker is live or starting: the
        # compiles waiting on it fail at once, not at the start timeout. The next compile
        # waits on a fresh one (and starts a fresh worker).
        self._no_worker: asyncio.Future[str] | None = None
        self._starting = 0
        self._live = 0
        self._on_compile, self._on_hit = on_compile, on_hit
        self._workers: set[_Worker] = set()
        self._closed = False
        self._starts: set[asyncio.Task[None]] = set()  # workers being started
        self.hits = 0
        self.compiles = 0
        self.abandoned = 0

    def start(self) -> None:
        """Start the first worker in the background (needs a running event loop)."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            self._spawn()

    async def check(self, spec: GrammarSpec) -> None:
        """Return if ``spec`` compiles within the budget; else raise its verdict."""
        key = spec.key
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            self.hits += 1
            if self._on_hit is not None:
                self._on_hit()
            verdict = self._verdicts[key]
        else:
            task = self._running.get(key)
            if task is None:
                task = asyncio.create_task(self._judge(spec))
                self._running[key] = task
            # Shielded: a client that leaves does not cut a compile short (see above).
            verdict = await asyncio.shield(task)
        if verdict is not None:
            kind, message = verdict
            raise kind(message)

    async def close(self) -> None:
        """Kill every worker, busy or idle (their compiles' callers get cancelled)."""
        self._closed = True
        for task in list(self._running.values()):
            task.cancel()
        for worker in list(self._workers):
            await worker.kill()
        # Starts in flight end once their worker is dead (or at once, if not created yet):
        # waited for, so the loop's shutdown cuts none of them off before it has reaped
        # its process.
        await asyncio.gather(*self._starts, return_exceptions=True)

    async def _judge(self, spec: GrammarSpec) -> Verdict:
        try:
            verdict = await self._compile(spec)
        finally:
            self._running.pop(spec.key, None)
        self._verdicts[spec.key] = verdict
        while len(self._verdicts) > self._max_cached:
            self._verdicts.popitem(last=False)
        return verdict

    async def _compile(self, spec: GrammarSpec) -> Verdict:
        first = self._idle is None
        self.start()  # the first compile's worker (its own start counts for it)
        assert self._idle is not None
        if not first and self._idle.empty() and self._live + self._starting < self.max_workers:
            self._spawn()
        worker = await self._take_worker()
        self.compiles += 1
        if self._on_compile is not None:
            self._on_compile()
        try:
            reply = await asyncio.wait_for(worker.compile(spec), self.timeout_s)
        except TimeoutError:
            self.abandoned += 1
            logger.warning(
                "a %s outlasted the %g s compile budget: its worker is killed",
                spec.kind.value,
                self.timeout_s,
            )
            await self._retire(worker)
            return GrammarTimeout, f"did not compile within {self.timeout_s:g} s"
        except (OSError, EOFError) as e:  # it died mid-compile: the grammar killed it
            logger.error("a grammar worker died compiling a %s: %s", spec.kind.value, e)
            await self._retire(worker)
            return GrammarError, f"the grammar engine failed on this {spec.kind.value}"
        except BaseException:
            await self._retire(worker)
            raise
        self._idle.put_nowait(worker)
        return None if reply.ok else (GrammarError, reply.error or "the grammar does not compile")

    async def _take_worker(self) -> _Worker:
        """An idle worker, once one is; raises ``GrammarUnavailable`` if none can start."""
        assert self._idle is not None
        if self._no_worker is None or self._no_worker.done():
            self._no_worker = asyncio.get_running_loop().create_future()
        failed = self._no_worker
        getter = asyncio.ensure_future(self._idle.get())
        try:
            await asyncio.wait(
                (getter, failed), timeout=STARTUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not getter.done():
                getter.cancel()  # a worker it was handed stays in the queue (asyncio.Queue)
        if getter.done() and not getter.cancelled():
            return getter.result()
        if failed.done():
            raise GrammarUnavailable(f"the grammar worker failed to start: {failed.result()}")
        raise GrammarUnavailable("no grammar worker could be started")

    async def _retire(self, worker: _Worker) -> None:
        self._live -= 1
        self._workers.discard(worker)
        if not self._closed:
            self._spawn()  # before the kill's await: a failing start meanwhile sees this one
        await worker.kill()

    def _spawn(self) -> None:
        self._starting += 1
        task = asyncio.get_running_loop().create_task(self._start_worker())
        self._starts.add(task)
        task.add_done_callback(self._starts.discard)

    async def _start_worker(self) -> None:
        assert self._idle is not None
        worker: _Worker | None = None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "frontend.engine_link.grammar_worker",
                msgspec.json.encode(self.config).decode(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            worker = _Worker(proc)
            self._workers.add(worker)
            if self._closed:  # close() ran while it was being created
                raise ConnectionError("the pool is closed")
            ready = await asyncio.wait_for(worker.read(), STARTUP_TIMEOUT_S)
            if not ready.ready:
                raise ConnectionError("the grammar worker did not say it was ready")
        except Exception as e:
            if not self._closed:  # else it was killed by close(), as it should be
                logger.error("a grammar worker failed to start: %s", e)
            self._starting -= 1
            if worker is not None:
                self._workers.discard(worker)
                if isinstance(e, asyncio.IncompleteReadError):  # it closed its pipe: exiting
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(worker.proc.wait(), _EXIT_WAIT_S)
                await worker.kill()  # reaped: its exit status is known
            failed = self._no_worker
            # Decided after the kill's await: a compile that arrived meanwhile may have
            # started another worker, which its waiters then wait for.
            if self._live == 0 and self._starting == 0 and failed and not failed.done():
                failed.set_result(_why(e, worker))
            return
        self._starting -= 1
        if self._closed:
            await worker.kill()
            return
        self._live += 1
        self._idle.put_nowait(worker)
