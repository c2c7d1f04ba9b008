"""Speculation tests run torch on one thread, as the engine tests do (shared cores)."""

from tests.engine.conftest import _one_torch_thread

__all__ = ["_one_torch_thread"]
