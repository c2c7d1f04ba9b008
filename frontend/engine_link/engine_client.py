"""The frontend's one view of the serving engine: submit, stream, abort, observe.

Who calls what, when:

* The HTTP handlers (``frontend/api/``) build an ``EngineRequest`` after
  tokenizing and validating (its rid from ``next_rid()``), then iterate ``generate(req)``. The first ``__anext__``
  admits the request: it raises ``Overloaded`` (answered with 503 + Retry-After) or
  ``EngineUnavailable`` before any delta is yielded, never after.
* Deltas arrive in order; the last one has ``finish != Finish.NONE`` and the iterator
  then ends. A delta with ``finish == Finish.ERROR`` carries ``error``.
* If the handler stops iterating before the last delta (client disconnect, cancellation),
  it calls ``abort(rid)``. ``abort`` is idempotent and a no-op for unknown or finished
  rids, so the handler may call it whenever it is unsure.
* ``check_admission()`` may run first, before the body is even parsed: it raises
  ``Overloaded`` when no request could be admitted now.
* ``health()`` and ``metrics_snapshot()`` are called from ``/health`` and ``/metrics``
  scrapes on the event loop: they must be cheap and must not block (read a load table,
  not a round trip to every worker).

Implementations: ``frontend/engine_link/client_rings.py`` (workers over shared-memory
rings) and, in tests, ``tests/frontend/reference_client.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from frontend.engine_link.board import FrontendBoard
from frontend.engine_link.lora_table import LoraTable
from frontend.engine_link.roles import RoleControl
from transport.worker_load import WorkerLoad
from wire.params import DetokParams, SamplingParams
from wire.records import TextDelta
from wire.rids import owned_rids


@dataclass(frozen=True)
class EngineRequest:
    """One admitted request, tokenized and validated by the frontend.

    ``rid`` is unique for the life of the server; the engine uses it in every record.
    ``forks``/``fork_of``: the choices of an ``n > 1`` request (GenerateRequest's fields):
    the first expects ``forks`` more, which name its rid and go to the same prefill
    worker, after it, to share the prompt's KV.
    """

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: DetokParams
    forks: int = 0
    fork_of: int = -1

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token the detokenizer must render (None = no logprobs)."""
        return self.sampling.logprobs


@dataclass(frozen=True)
class WorkerHealth:
    """One worker process as ``/health`` reports it; ``load`` is role-specific.

    ``state`` is the worker's lifecycle state (starting, ready, dead, failed, ...);
    ``reason`` says how a dead or failed worker died. ``node`` names the host it runs on
    (``--node-name`` or the host name; "" for a worker no node has brought yet).
    ``retry_at``: for a worker in crash-loop back-off (``failed``), the Unix time the
    launcher starts it again.
    """

    role: str  # Role.health_label
    index: int
    pid: int
    alive: bool
    load: dict[str, float] = field(default_factory=dict)
    state: str = "ready"
    reason: str | None = None
    node: str = ""
    # ``launch --workers``: what the worker serves as now (``transport/role_table.py``):
    # prefill, decode or colocated; None for a worker whose role is fixed.
    serving_role: str | None = None
    retry_at: float | None = None


@dataclass(frozen=True)
class WorkerReport:
    """One worker as ``/metrics`` shows it: who and where it is (``node`` as
    ``WorkerHealth.node``), its load, and what the router has placed on it since the
    frontend started (tokens: the prompt for prefill, prompt + max_tokens for decode)."""

    role: str  # a Role's value
    index: int
    load: WorkerLoad
    node: str = ""
    assigned_requests: int = 0
    assigned_tokens: int = 0

    @property
    def speculation(self) -> tuple[int, ...]:
        """The speculative-decoding counters of a worker that decodes; () for others."""
        return self.load.speculation if self.role in ("decode", "colocated") else ()


class EngineClientError(Exception):
    """Base of the errors an engine client raises to the frontend."""


class Overloaded(EngineClientError):
    """Admission refused: no worker can take the request now; retry after a while."""

    def __init__(self, retry_after_s: float, message: str = "server overloaded") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(EngineClientError):
    """The request cannot be served (workers dead, engine crashed); not the user's fault."""


class EngineClient(ABC):
    """Abstract engine connection shared by every HTTP handler of one frontend process.

    ``owner`` is this frontend's index (``launch --api-workers``): every rid it hands out
    names it (``wire/rids.py``), so the request's output comes back to this process.
    """

    owner: int = 0
    # What this frontend shares with the others (None: it is the only one, in tests).
    board: FrontendBoard | None = None
    # The host's KV tier counters (engine/kv/tiers/host_store.py), when the tiers are on.
    kv_tier_counters: Callable[[], dict[str, int]] | None = None
    # The LoRA adapters every frontend of the server serves (None: this one's alone).
    lora_table: LoraTable | None = None
    # ``launch --workers``: the workers' roles and their planner (None: fixed roles).
    role_control: RoleControl | None = None
    # Called once for each request ended as poison (``/metrics`` counts them).
    on_poisoned: Callable[[], object] | None = None
    _rids: Iterator[int] | None = None

    def next_rid(self) -> int:
        """A request id of this frontend, unique for the life of the server."""
        if self._rids is None:
            self._rids = owned_rids(self.owner)
        return next(self._rids)

    @abstractmethod
    def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        """Admit ``req`` and yield its ``TextDelta``s until one with ``finish != 0``.

        Raises ``Overloaded`` or ``EngineUnavailable`` on the first ``__anext__`` only.
        Concatenated ``text`` of the deltas is the request's output text; the
        concatenated ``token_ids`` are its output token ids.
        """

    @abstractmethod
    def check_admission(self) -> None:
        """Raise ``Overloaded`` if ``generate`` would now refuse any request, however small.

        Called before a body is parsed and tokenized, so overload is refused cheaply; it
        commits nothing, and ``generate`` still decides for the requests it lets by.
        Must be cheap and must not block.
        """

    @abstractmethod
    async def abort(self, rid: int) -> None:
        """Stop ``rid`` everywhere and free its KV; idempotent, returns promptly."""

    @abstractmethod
    def health(self) -> list[WorkerHealth]:
        """Every worker's role, index, pid, liveness and load; non-blocking."""

    @abstractmethod
    def metrics_snapshot(self) -> list[WorkerReport]:
        """Per-worker running/waiting requests and KV usage; non-blocking."""

    async def reset_prefix_cache(self) -> object:
        """Forget every cached prefix, in every worker's pool and every KV tier, and
        return what was done once it is (``frontend/engine_link/prefix_reset.py``)."""
        raise NotImplementedError("this engine client cannot reset prefix caches")

    async def unload_lora(self, fingerprint: str) -> None:  # noqa: B027 - optional hook
        """Tell every worker to free the LoRA adapter with ``fingerprint`` now. By default
        nothing: a client whose engine keeps no adapters resident has nothing to free."""

    async def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release the client's resources at server shutdown."""
