"""Typed exceptions the engine raises at its boundaries."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class UnsupportedModelError(EngineError, ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""


class NoFreeBlocks(EngineError):
    """The KV pool has fewer free blocks than asked for; nothing was allocated."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"asked for {wanted} KV blocks, {free} free")
        self.wanted = wanted
        self.free = free


class PromptTooLongError(EngineError, ValueError):
    """A prompt leaves no room for one output token within max_model_len."""
