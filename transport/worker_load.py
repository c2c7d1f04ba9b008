"""A worker's load: the one record of its counters, written by the worker into its
load-table row, read by the router to place requests and by the frontend for /metrics.

Queue figures are the scheduler's, KV figures the runner's; the ``*_received`` and
``prefix_*``/``computed_prefill_tokens``/``spec_*`` counters are cumulative over the
worker's current generation (a restarted worker starts again from zero).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SPECULATION_POSITIONS = 8  # draft positions whose accepted tokens a row counts
SPECULATION_SKIP_REASONS = ("batch_size", "low_acceptance", "no_draft", "length", "no_kv_blocks")
SPECULATION_FIELDS = (
    "speculation_drafts",
    "speculation_draft_tokens",
    "speculation_accepted_tokens",
    *(f"spec_accepted_pos_{i}" for i in range(SPECULATION_POSITIONS)),
    *(f"spec_skipped_{r}" for r in SPECULATION_SKIP_REASONS),
)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker reports each step; every field is an integer a load-table row stores."""

    queued_prefill_tokens: int = 0  # prompt tokens waiting for prefill
    waiting_requests: int = 0
    running_requests: int = 0
    free_kv_blocks: int = 0  # cached (evictable) blocks count as free
    total_kv_blocks: int = 0
    # What the worker took off its request channel: the router compares them with what it
    # sent to know what is still in flight.
    requests_received: int = 0
    prompt_tokens_received: int = 0
    # Prefix caching: blocks holding a hashed prefix (reusable, in use or not), and prompt
    # tokens looked up / found cached (on decode: KV handed off, and not copied).
    cached_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    # Prompt tokens the worker ran through the model: below prompt_tokens_received when
    # prompts share KV (n > 1 choices, cached prefixes).
    computed_prefill_tokens: int = 0
    # LoRA (engine/checkpoint/lora_loader.py): adapters resident now, and loads so far.
    lora_adapters: int = 0
    lora_loads: int = 0
    # The latest prefix-cache reset (``ResetPrefixCache.epoch``) the worker has done: the
    # frontend answers POST /reset_prefix_cache once every worker shows its epoch.
    prefix_reset_epoch: int = 0
    # Speculative decoding (decode and co-located workers): request-steps that verified
    # drafts, draft tokens, accepted ones, accepted ones by draft position (the first
    # SPECULATION_POSITIONS), request-steps that did not speculate by reason (SPECULATION_SKIP_REASONS).
    speculation_drafts: int = 0
    speculation_draft_tokens: int = 0
    speculation_accepted_tokens: int = 0
    spec_accepted_pos_0: int = 0
    spec_accepted_pos_1: int = 0
    spec_accepted_pos_2: int = 0
    spec_accepted_pos_3: int = 0
    spec_accepted_pos_4: int = 0
    spec_accepted_pos_5: int = 0
    spec_accepted_pos_6: int = 0
    spec_accepted_pos_7: int = 0
    spec_skipped_batch_size: int = 0
    spec_skipped_low_acceptance: int = 0
    spec_skipped_no_draft: int = 0
    spec_skipped_length: int = 0
    spec_skipped_no_kv_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool in use, in [0, 1] (0 before the pool exists)."""
        total = max(self.total_kv_blocks, 1)
        return (self.total_kv_blocks - self.free_kv_blocks) / total

    @property
    def prefix_hit_rate(self) -> float:
        q = self.prefix_queried_tokens
        return self.prefix_hit_tokens / q if q else 0.0

    @property
    def speculation(self) -> tuple[int, ...]:
        """The ``SPECULATION_FIELDS`` counters, in order."""
        return tuple(getattr(self, name) for name in SPECULATION_FIELDS)


LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerLoad))
assert LOAD_FIELDS[-len(SPECULATION_FIELDS) :] == SPECULATION_FIELDS
