"""Which runners take the Triton kernel path: CPU serving never does unless forced."""

from __future__ import annotations

import pytest

from engine.cuda.kernels import next_power_of_2, triton_available, use_kernels


def test_cpu_serving_stays_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_kernels("auto", "cpu") and not use_kernels("torch", "cuda")
    with pytest.raises(ValueError, match="attention_backend"):
        use_kernels("flash", "cuda")
    if triton_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            use_kernels("triton", "cpu")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert use_kernels("triton", "cpu")


def test_next_power_of_2() -> None:
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 7, 8, 9, 128)] == [1, 1, 2, 4, 8, 8, 16, 128]
