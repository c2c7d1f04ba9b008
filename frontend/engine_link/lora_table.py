"""The LoRA adapters every frontend of a server serves, in one small shared segment.

``launch --api-workers N`` starts N frontends behind one port, and a client's next
connection may land on any of them: an adapter loaded through one must be served by all,
and one unloaded through another must be gone from all. The launcher creates this
segment (``layout_nbytes``, ``format``) before any frontend starts; each frontend maps it
(``frontend/api/common/lora_registry.py``), and a restarted one finds every adapter loaded
before it died.

Layout (little-endian u64 words, then UTF-8 JSON):
    [0] magic  [1] generation (bumped by every change)  [2] JSON length
    [3..]      {"seeded": bool, "adapters": [[name, path, fingerprint], ...]}, the
               adapters in the order registered; ``seeded``: the ``--lora-modules`` ones
               were registered (once per server, by the first frontend to start: a later
               or restarted one keeps whatever the server holds now)

Every change is a read-modify-write under one lock: a POSIX record lock on the segment's
fd (it excludes other processes) plus a process-wide mutex (record locks do not exclude
threads, and loads run off the event loop). Readers take the lock too; a frontend skips
the read while the generation word (one aligned 8-byte store) is the one it last read.
"""

from __future__ import annotations

import fcntl
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from frontend.errors import InvalidRequest
from wire.params import LoraRef

MAGIC = 0x5044_4C4F_5241_0001  # "PDLORA", format 1
_HEAD = 3  # u64 words before the JSON
_PROCESS_LOCK = threading.Lock()


def layout_nbytes(max_loras: int) -> int:
    """Room for ``max_loras`` adapters with names and paths as long as Linux allows."""
    return 8 * _HEAD + max(1, max_loras) * (256 + 4096 + 128) + 64


def format_table(buf: memoryview) -> None:
    """An empty table in a fresh segment (the launcher, before any frontend starts)."""
    head = np.frombuffer(buf, dtype="<u8", count=_HEAD)
    empty = json.dumps({"seeded": False, "adapters": []}).encode()
    buf[8 * _HEAD : 8 * _HEAD + len(empty)] = empty
    head[1], head[2] = 0, len(empty)
    head[0] = MAGIC


class LoraTable:
    """The shared list of registered adapters (``fd`` None: one process's, for a frontend
    run without a launcher)."""

    def __init__(self, fd: int | None, buf: memoryview) -> None:
        self.fd, self.buf = fd, buf
        self.head = np.frombuffer(buf, dtype="<u8", count=_HEAD)
        if int(self.head[0]) != MAGIC:
            raise ValueError("not a LoRA table segment (or one of another format)")

    @classmethod
    def private(cls, max_loras: int) -> LoraTable:
        buf = memoryview(bytearray(layout_nbytes(max_loras)))
        format_table(buf)
        return cls(None, buf)

    @property
    def generation(self) -> int:
        return int(self.head[1])

    def read(self) -> tuple[int, list[LoraRef]]:
        """(generation, the adapters registered, in order)."""
        with self._locked():
            return self.generation, _refs(self._doc())

    @property
    def seeded(self) -> bool:
        with self._locked():
            return bool(self._doc()["seeded"])

    def seed(self, refs: list[LoraRef]) -> None:
        """Register the server's startup adapters, unless a frontend did already."""
        with self._locked():
            doc = self._doc()
            if not doc["seeded"]:
                self._write(True, [*refs, *_refs(doc)])

    def update(self, change: Callable[[list[LoraRef]], list[LoraRef]]) -> list[LoraRef]:
        """Replace the list with ``change(list)`` atomically with respect to every other
        frontend; ``change`` may raise (an ``APIError``), leaving the table as it was."""
        with self._locked():
            doc = self._doc()
            new = change(_refs(doc))
            self._write(bool(doc["seeded"]), new)
            return new

    def _write(self, seeded: bool, refs: list[LoraRef]) -> None:
        rows = [[r.name, r.path, r.fingerprint] for r in refs]
        data = json.dumps({"seeded": seeded, "adapters": rows}).encode()
        if 8 * _HEAD + len(data) > len(self.buf):
            raise InvalidRequest(
                "the adapters' names and paths do not fit the server's LoRA table; "
                "unload one first",
                param="lora_path",
            )
        self.buf[8 * _HEAD : 8 * _HEAD + len(data)] = data
        self.head[2] = len(data)
        self.head[1] += np.uint64(1)

    def _doc(self) -> dict[str, Any]:
        n = int(self.head[2])
        doc: dict[str, Any] = json.loads(bytes(self.buf[8 * _HEAD : 8 * _HEAD + n]))
        return doc

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with _PROCESS_LOCK:
            if self.fd is None:
                yield
                return
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)


def _refs(doc: dict[str, Any]) -> list[LoraRef]:
    return [LoraRef(name=a, path=b, fingerprint=c) for a, b, c in doc["adapters"]]
