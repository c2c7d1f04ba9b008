"""The load table's seqlock barriers (``transport/load_table.py`` says why they are
needed): ``transport._atomics``' C ``__atomic`` builtins where built, else plain accesses,
which x86-64's ordering makes correct and which leave rows advisory elsewhere (a warning
says so)."""

from __future__ import annotations

import logging
import platform

import numpy as np

logger = logging.getLogger(__name__)

try:
    from transport import _atomics
except ImportError:  # pragma: no cover - depends on whether the C helper was built
    _atomics = None  # type: ignore[assignment]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        logger.warning(
            "transport._atomics is not built: load-table reads are unfenced on %s and may "
            "be torn; build it (pip install -e .) for correct ordering",
            platform.machine(),
        )


def fence() -> None:
    if _atomics is not None:
        _atomics.fence()


def load_acquire(addr: int, rows: np.ndarray, slot: int) -> int:
    if _atomics is not None:
        return _atomics.load_acquire(addr)
    return int(rows["seq"][slot])


def store_release(addr: int, seq_view: np.ndarray, value: int) -> None:
    if _atomics is not None:
        _atomics.store_release(addr, value)
    else:
        seq_view[0] = value
