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
from dataclasses import dataclass, field
from typing import Any

from runtime.cpu_affinity import keep_to_env_cpus
from transport.doorbell import Doorbell
from transport.load_table import LoadTable
from transport.prefix_summary import PrefixSummary
from transport.ring import Ring, RingSpec
from transport.segment import Segment, SegmentSpec
from wire.json_spec import JsonSpec
from wire.ring_names import RingKind, RingName
from wire.roles import Role

SPEC_ENV = "PDSERVE_SPEC"
PARENT_ENV = "PDSERVE_PARENT"  # the pid a child's parent must have: the launcher's
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int) -> None:
    """``prctl(2)`` with one argument; raises ``OSError`` on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def set_title(name: str) -> None:
    """The process's title, as ``ps`` and /proc/PID/cmdline show it."""
    try:
        import setproctitle

        setproctitle.setproctitle(name)
    except ImportError:  # pragma: no cover - a declared dependency
        pass


@dataclass(frozen=True)
class ProcessSpec(JsonSpec):
    """What one child needs, as JSON. Every fd named here is inherited from the launcher."""

    role: Role
    index: int
    doorbell_fd: int
    rings_in: dict[str, dict[str, Any]] = field(default_factory=dict)
    rings_out: dict[str, dict[str, Any]] = field(default_factory=dict)
    load_table: dict[str, Any] = field(default_factory=dict)  # fd, nbytes, num_workers, slot
    kv_pools: dict[str, dict[str, Any]] = field(default_factory=dict)  # p{i} -> fd, layout
    settings: dict[str, Any] = field(default_factory=dict)  # role-specific configuration
    # Engine workers' prefix summaries (transport/prefix_summary.py), by peer name (p0, d1,
    # c0) -> fd, nbytes: a worker gets its own, the frontend every one.
    prefix_summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Other shared segments by tag -> fd, nbytes (the frontends' board, to frontends).
    segments: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> ProcessSpec:
        fields = json.loads(text)
        return cls(**{**fields, "role": Role(fields["role"])})

    def fds(self) -> list[int]:
        out = [self.doorbell_fd]
        for rings in (self.rings_in, self.rings_out):
            for r in rings.values():
                out += [r["fd"], r["doorbell_fd"], r["space_fd"]]
        if self.load_table:
            out.append(self.load_table["fd"])
        out += [p["fd"] for p in self.kv_pools.values()]
        out += [p["fd"] for p in self.prefix_summaries.values()]
        out += [s["fd"] for s in self.segments.values()]
        return sorted(set(out))


class Stopping:
    """Set by SIGTERM/SIGINT; loops check it between steps and exit cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()


def bootstrap() -> tuple[ProcessSpec, Stopping]:
    """Parse the spec, set the process title and logging, keep to the cores the launcher
    chose (if any), and die with the parent."""
    spec = ProcessSpec.from_json(os.environ[SPEC_ENV])
    name = f"pdserve:{spec.role.worker_name(spec.index)}"
    set_title(name)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    keep_to_env_cpus()  # before any thread starts: they inherit the mask
    # The launcher died before prctl took effect: we were re-parented (to init, or to a
    # subreaper above the launcher; the launcher says its pid, a bare test run does not).
    # A launcher that is a container's init is pid 1 itself: trust its word where it gives it.
    parent = os.environ.get(PARENT_ENV)
    orphaned = os.getppid() != int(parent) if parent is not None else os.getppid() == 1
    if orphaned:
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


@dataclass(frozen=True)
class Rings:
    """A process's attached rings by name; the helpers key them by the peer's index."""

    inbound: dict[RingName, Ring]
    outbound: dict[RingName, Ring]
    doorbell: Doorbell

    def sources(self, kind: RingKind, role: Role | None = None) -> dict[int, Ring]:
        """Inbound rings of ``kind`` (from peers of ``role``), by the sender's index."""
        return {
            n.src.index: r
            for n, r in sorted(self.inbound.items())
            if n.kind is kind and role in (None, n.src.role)
        }

    def sinks(self, kind: RingKind, role: Role | None = None) -> dict[int, Ring]:
        """Outbound rings of ``kind`` (to peers of ``role``), by the receiver's index."""
        return {
            n.dst.index: r
            for n, r in sorted(self.outbound.items())
            if n.kind is kind and role in (None, n.dst.role)
        }

    def one_in(self, kind: RingKind) -> Ring:
        """The single inbound ring of ``kind`` (e.g. a worker's request ring)."""
        (ring,) = self.sources(kind).values()
        return ring

    def one_out(self, kind: RingKind) -> Ring:
        (ring,) = self.sinks(kind).values()
        return ring


def attach_rings(spec: ProcessSpec) -> Rings:
    """Attach every ring of the spec; inbound rings are reset (a predecessor's leftovers)."""
    inbound = {
        RingName.parse(n): Ring.attach(RingSpec(**s), "consumer") for n, s in spec.rings_in.items()
    }
    outbound = {
        RingName.parse(n): Ring.attach(RingSpec(**s), "producer") for n, s in spec.rings_out.items()
    }
    for ring in inbound.values():
        ring.reset()
    return Rings(inbound, outbound, Doorbell(spec.doorbell_fd))


def prefix_summaries(spec: ProcessSpec) -> dict[str, tuple[PrefixSummary, Segment]]:
    """Map every prefix summary of the spec, by peer name (keep the segments open)."""
    out = {}
    for name, s in spec.prefix_summaries.items():
        seg = Segment.attach(SegmentSpec(f"summary.{name}", s["fd"], s["nbytes"]))
        out[name] = (PrefixSummary(seg.buf), seg)
    return out


def shared_segment(spec: ProcessSpec, tag: str) -> Segment | None:
    """Map the spec's segment ``tag`` (keep it open), or None if the spec has none."""
    s = spec.segments.get(tag)
    return None if s is None else Segment.attach(SegmentSpec(tag, s["fd"], s["nbytes"]))


def load_table(spec: ProcessSpec) -> tuple[LoadTable, Segment]:
    lt = spec.load_table
    seg = Segment.attach(SegmentSpec("load", lt["fd"], lt["nbytes"]))
    return LoadTable(seg.buf, lt["num_workers"]), seg
