"""Engine tests run torch on one thread: the suite shares two cores with other packages'
tests, and OpenMP barriers degrade badly when threads outnumber free cores. ``int4_kernel``
runs a test once per int4 kernel this CPU has."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.weights import int4_tiles


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=int4_tiles.KERNELS)
def int4_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each int4 kernel in turn (``engine/weights/int4_tiles.py``), skipping those this CPU
    cannot run; packed layers built during the test use it."""
    name = str(request.param)
    if name not in int4_tiles.available_kernels():
        pytest.skip(f"the {name} int4 kernel does not run on this CPU")
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", name)
    return name
