"""What every handler is given and checks first: the per-app context (engine client,
tokenizer, settings, metrics, grammars, adapters), the model a request names, the time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend.engine_link.engine_client import EngineClient
from frontend.engine_link.grammar_pool import GrammarPool
from frontend.errors import ModelNotFound
from frontend.settings import FrontendSettings
from frontend.telemetry.metrics import FrontendMetrics
from wire.params import LoraRef

if TYPE_CHECKING:
    from frontend.api.common.lora_registry import LoraRegistry

# Prompts up to this many characters are tokenized on the event loop (tens of microseconds).
INLINE_ENCODE_CHARS = 2048


@dataclass
class ServingContext:
    """Per-app state every handler needs."""

    client: EngineClient
    tokenizer: Any
    settings: FrontendSettings
    metrics: FrontendMetrics
    grammars: GrammarPool
    loras: LoraRegistry | None = None  # with --enable-lora

    def next_rid(self) -> int:
        return self.client.next_rid()

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_ENCODE_CHARS:
            # Cheaper than the round trip through a worker thread, and under a burst the
            # thread pool's hand-offs cost the event loop more than the encoding itself.
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        # Tokenizing megabytes of text takes a while; keep the event loop serving.
        ids = await asyncio.to_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )
        return list(ids)


def check_model(ctx: ServingContext, requested: str | None) -> LoraRef | None:
    """A request's ``model``: None for the base (or none given), the adapter's ref for a
    registered LoRA adapter; else 404 naming what is served."""
    names = (ctx.settings.model_name, *ctx.settings.model_aliases)
    if requested is None or requested in names:
        return None
    ref = ctx.loras.resolve(requested) if ctx.loras is not None else None
    if ref is None:
        raise ModelNotFound(requested, ctx.settings.model_name)
    return ref


def now_s() -> int:
    return int(time.time())
