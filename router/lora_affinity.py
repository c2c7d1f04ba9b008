"""Where each LoRA adapter is probably resident: the router's memory of where it sent it.

A worker holds at most ``--max-loras`` adapters, least recently used out first
(``engine/checkpoint/lora_loader.py``); the router keeps the same bounded LRU per worker
of the adapters it placed there, so it can prefer a worker that will not have to load
(and evict) one. It is a preference, not a rule: a holder is chosen only when its load is
within ``slack_tokens`` of the least loaded worker's, and any worker can load any adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class AdapterAffinity:
    def __init__(self, per_worker: int, slack_tokens: int = 2048) -> None:
        self.per_worker, self.slack_tokens = per_worker, slack_tokens
        self._held: dict[Hashable, OrderedDict[str, None]] = {}

    def holds(self, worker: Hashable, fingerprint: str) -> bool:
        held = self._held.get(worker)
        return held is not None and fingerprint in held

    def sent(self, worker: Hashable, fingerprint: str) -> None:
        held = self._held.setdefault(worker, OrderedDict())
        held[fingerprint] = None
        held.move_to_end(fingerprint)
        while len(held) > self.per_worker:
            held.popitem(last=False)

    def forget(self, fingerprint: str) -> None:
        """The adapter was unloaded everywhere (POST /v1/unload_lora_adapter)."""
        for held in self._held.values():
            held.pop(fingerprint, None)
