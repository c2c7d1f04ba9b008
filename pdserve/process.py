"""What every child process of a server does first: read its spec, name itself, attach.

A child is started by the launcher with its ``ProcessSpec`` as JSON in the environment
variable ``PDSERVE_SPEC`` and the fds the spec names inherited. It dies with the launcher
(``PR_SET_PDEATHSIG``), so a SIGKILLed launcher leaves no orphans behind.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from router.load_table import LoadTable, RowWriter
from transport.doorbell import Doorbell
from transport.ring import Ring, RingSpec
from transport.segment import Segment, SegmentSpec

SPEC_ENV = "PDSERVE_SPEC"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessSpec:
    """What one child needs, as JSON. Every fd named here is inherited from the launcher."""

    role: str  # frontend | prefill | decode | detok
    index: int
    doorbell_fd: int
    rings_in: dict[str, dict[str, Any]] = field(default_factory=dict)
    rings_out: dict[str, dict[str, Any]] = field(default_factory=dict)
    load_table: dict[str, Any] = field(default_factory=dict)  # fd, nbytes, num_workers, slot
    kv_pools: dict[str, dict[str, Any]] = field(default_factory=dict)  # p{i} -> fd, layout
    settings: dict[str, Any] = field(default_factory=dict)  # role-specific configuration

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProcessSpec:
        return cls(**json.loads(text))

    def fds(self) -> list[int]:
        out = [self.doorbell_fd]
        for rings in (self.rings_in, self.rings_out):
            for r in rings.values():
                out += [r["fd"], r["doorbell_fd"], r["space_fd"]]
        if self.load_table:
            out.append(self.load_table["fd"])
        out += [p["fd"] for p in self.kv_pools.values()]
        return sorted(set(out))


class Stopping:
    """Set by SIGTERM/SIGINT; loops check it between steps and exit cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()


def bootstrap() -> tuple[ProcessSpec, Stopping]:
    """Parse the spec, set the process title and logging, and die with the parent."""
    spec = ProcessSpec.from_json(os.environ[SPEC_ENV])
    name = f"pdserve:{spec.role}" + (f"-{spec.index}" if spec.role != "frontend" else "")
    try:
        import setproctitle

        setproctitle.setproctitle(name)
    except ImportError:  # pragma: no cover - a declared dependency
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before prctl took effect
        sys.exit(1)
    level = spec.settings.get("log_level", "INFO")
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    stopping = Stopping()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return spec, stopping


def attach_rings(spec: ProcessSpec) -> tuple[dict[str, Ring], dict[str, Ring], Doorbell]:
    """Attach every ring of the spec; inbound rings are reset (a predecessor's leftovers)."""
    doorbell = Doorbell(spec.doorbell_fd)
    rings_in = {n: Ring.attach(RingSpec(**s), "consumer") for n, s in spec.rings_in.items()}
    rings_out = {n: Ring.attach(RingSpec(**s), "producer") for n, s in spec.rings_out.items()}
    for ring in rings_in.values():
        ring.reset()
    return rings_in, rings_out, doorbell


def load_table(spec: ProcessSpec) -> tuple[LoadTable, Segment]:
    lt = spec.load_table
    seg = Segment.attach(SegmentSpec("load", lt["fd"], lt["nbytes"]))
    return LoadTable(seg.buf, lt["num_workers"]), seg


def load_row(spec: ProcessSpec) -> tuple[RowWriter, Segment]:
    table, seg = load_table(spec)
    return table.writer(spec.load_table["slot"]), seg
