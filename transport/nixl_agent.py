"""NIXL itself, apart from the KV backend built on it (``kv_nixl``): loading whichever wheel
is installed (``load_nixl``, ``NixlUnavailable`` naming the extra to install), its error
types, an agent and the thread that progresses it while an exporter serves READs, and the
check that a remote pool's blocks are laid out as ours (``check_compatible``, which a
joining node's layout meets before any NIXL call).
"""

from __future__ import annotations

import collections
import importlib
import logging
import threading
import time
from types import ModuleType
from typing import Any

from transport.errors import ClusterUnavailable, KVTransferError
from wire.kv_layout import KVLayout
from wire.records import KVRelease, RecordError, decode

logger = logging.getLogger(__name__)

NIXL_EXTRA = "pip install 'pdserve[nixl]'"
# The wheels name their module for the CUDA they were built against; the ``nixl`` meta
# package re-exports one of them. Any of them serves DRAM; VRAM needs the matching CUDA.
_MODULES = ("nixl._api", "nixl_cu13", "nixl_cu12")
BACKEND = "UCX"
_EXPORT_POLL_S = 0.0005


class NixlUnavailable(ClusterUnavailable):
    """NIXL is not installed: the multi-host KV backend cannot run."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(
            "KV transfer between hosts needs NIXL, an optional extra: "
            f"{NIXL_EXTRA}" + (f" ({detail})" if detail else "")
        )


class KVLayoutMismatch(KVTransferError):
    """A remote pool whose blocks are not laid out as ours: its bytes cannot be copied."""


def load_nixl() -> ModuleType:
    """The installed NIXL Python API (the module holding ``nixl_agent``)."""
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise NixlUnavailable("; ".join(errors))


_COMPARED = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "order")


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise ``KVLayoutMismatch`` unless a block of ``remote`` is a block of ``local``.

    Only the block count may differ. Called when a peer joins (with the layout it
    announces) and again when its pool handle is opened.
    """
    diffs = [
        f"{f} {getattr(remote, f)} (here {getattr(local, f)})"
        for f in _COMPARED
        if getattr(local, f) != getattr(remote, f)
    ]
    if diffs:
        raise KVLayoutMismatch("remote KV pool layout differs: " + ", ".join(diffs))


def nixl_errors(nixl: ModuleType) -> tuple[type[Exception], ...]:
    """The exception types NIXL's bindings raise (they share no base class but Exception)."""
    bindings = getattr(importlib.import_module(nixl.nixl_agent.__module__), "nixlBind", None)
    found = (
        tuple(
            obj
            for name, obj in vars(bindings).items()
            if name.startswith("nixl") and isinstance(obj, type) and issubclass(obj, Exception)
        )
        if bindings is not None
        else ()
    )
    return found or (RuntimeError,)


def new_agent(nixl: ModuleType, name: str) -> Any:
    """A NIXL agent named ``name`` on UCX, with no progress thread of its own."""
    # NOTE: no NIXL progress thread: the Python API starts it with no delay between
    # polls, a whole core per agent while idle. A receiver progresses its own agent while
    # it waits for a READ; an exporter runs ``Progress`` only while READs may come.
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=[BACKEND])
    agent = nixl.nixl_agent(name, config)
    if BACKEND not in agent.backends:
        raise NixlUnavailable(f"its {BACKEND} plugin did not load")
    return agent


class Progress:
    """Progresses an exporter's agent while its owner says READs may come.

    A READ over a transport without remote memory access (UCX over TCP) is served by the
    source's worker, and connecting needs it too: something must progress the source's
    agent while a decode worker reads, also while the prefill worker's own thread is busy
    in a forward. This thread polls every ``_EXPORT_POLL_S`` while ``active`` and sleeps
    on an event otherwise, so an exporter with nothing pinned costs no CPU. It is the only
    caller of the agent after construction; releases pass to the owner through a deque.
    """

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.releases: collections.deque[KVRelease] = collections.deque()
        self._wanted = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
        self._thread.start()

    def active(self, on: bool) -> None:
        if on:
            self._wanted.set()
        else:
            self._wanted.clear()

    def _run(self) -> None:
        while not self._stop:
            self._wanted.wait()
            while self._wanted.is_set() and not self._stop:
                self._collect()
                time.sleep(_EXPORT_POLL_S)
            self._collect()  # what came with the last READs

    def _collect(self) -> None:
        for peer, messages in self.agent.get_new_notifs().items():
            for message in messages:
                try:
                    record = decode(message)
                except RecordError as e:
                    logger.warning("nixl: unreadable notification from %s: %s", peer, e)
                    continue
                if isinstance(record, KVRelease):
                    self.releases.append(record)
                else:
                    logger.warning("nixl: notification from %s is not a KVRelease", peer)

    def stop(self) -> None:
        self._stop = True
        self._wanted.set()
        self._thread.join(5)
