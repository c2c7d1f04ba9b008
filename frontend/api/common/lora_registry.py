"""The LoRA adapters this frontend serves: name -> (path, fingerprint), and the endpoints
that change them (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, vLLM's
names and bodies).

The endpoints are ``lora.py``'s. An adapter is checked here before any request can name
it, without torch: its
``adapter_config.json`` and the safetensors header (``engine/weights/lora_spec.py``) must
describe a plain LoRA on the served projections whose shapes fit the base and whose rank
is at most ``--max-lora-rank``; at most ``--max-loras`` are registered at once. Every
refusal is a 400 (404 for an unknown name) naming the problem; the server serves on.

A request names an adapter as its ``model``; ``resolve`` gives the ``LoraRef`` that
travels in its sampling options to the workers, which load the adapter from its path
themselves and check its fingerprint (``engine/checkpoint/lora_loader.py``).

The list itself is the server's, not this process's (``engine_link/lora_table.py``):
with ``--api-workers`` > 1 an adapter loaded through one frontend is served through every
one, an unload through any is seen by all, and a restarted frontend finds them all. Each
frontend keeps the list it last read and reads it again when its generation moved.
"""

from __future__ import annotations

import logging

from engine.weights.lora_spec import BaseDims, LoraError, read_lora
from frontend.engine_link.lora_table import LoraTable
from frontend.errors import APIError, InvalidRequest
from frontend.settings import FrontendSettings
from wire.params import LoraRef

logger = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, settings: FrontendSettings, table: LoraTable | None = None) -> None:
        self.max_loras, self.max_rank = settings.max_loras, settings.max_lora_rank
        self.base_name = settings.model_name
        self.base = BaseDims.from_model_dir(settings.base_model_dir)
        self.table = table if table is not None else LoraTable.private(self.max_loras)
        self._generation = -1
        self._adapters: dict[str, LoraRef] = {}
        if settings.lora_modules and not self.table.seeded:
            # A bad --lora-modules entry stops startup; a later or restarted frontend keeps
            # the server's adapters as they are now (some may have been unloaded since).
            refs = [self._check(name, path) for name, path in settings.lora_modules]
            if len(refs) > self.max_loras or len({r.name for r in refs}) < len(refs):
                raise InvalidRequest("--lora-modules: a name twice, or more than --max-loras")
            self.table.seed(refs)
            logger.info("LoRA adapters registered: %s", ", ".join(r.name for r in refs))

    @property
    def adapters(self) -> dict[str, LoraRef]:
        """name -> adapter, as every frontend of the server has them registered now."""
        if self.table.generation != self._generation:
            self._generation, refs = self.table.read()
            self._adapters = {r.name: r for r in refs}
        return self._adapters

    def load(self, name: str, path: str) -> LoraRef:
        """Check and register; raises ``APIError`` (400) naming what is wrong."""
        if name in self.adapters:  # before hashing its weights
            raise _already(name)
        ref = self._check(name, path)

        def register(refs: list[LoraRef]) -> list[LoraRef]:
            if any(r.name == name for r in refs):
                raise _already(name)
            if len(refs) >= self.max_loras:
                raise InvalidRequest(
                    f"{len(refs)} LoRA adapters are loaded, as many as --max-loras "
                    f"({self.max_loras}) allows; unload one first",
                    param="lora_name",
                )
            return [*refs, ref]

        self.table.update(register)
        logger.info("LoRA adapter %r registered", name)
        return ref

    def _check(self, name: str, path: str) -> LoraRef:
        """The adapter at ``path`` as ``name``, if it can be served; ``APIError`` (400)."""
        if not name or name == self.base_name:
            raise InvalidRequest(
                f"lora_name {name!r} is empty or the base model's name", param="lora_name"
            )
        try:
            spec = read_lora(path)
            spec.check_fits(self.base, self.max_rank)
        except LoraError as e:
            raise InvalidRequest(f"LoRA adapter {name!r}: {e}", param="lora_path") from None
        logger.info(
            "LoRA adapter %r checked: %s, rank %d, %s",
            name,
            spec.path,
            spec.rank,
            ",".join(spec.targets),
        )
        return LoraRef(name=name, path=spec.path, fingerprint=spec.fingerprint)

    def unload(self, name: str) -> LoraRef:
        """Unregister ``name``; raises ``APIError`` (404) if no adapter has that name."""
        gone: list[LoraRef] = []

        def unregister(refs: list[LoraRef]) -> list[LoraRef]:
            gone.extend(r for r in refs if r.name == name)
            if not gone:
                raise APIError(
                    f"no LoRA adapter named {name!r} is loaded",
                    param="lora_name",
                    code="lora_not_found",
                    status=404,
                )
            return [r for r in refs if r.name != name]

        self.table.update(unregister)
        logger.info("LoRA adapter %r unregistered", name)
        return gone[0]

    def serves(self, fingerprint: str) -> bool:
        """Whether some registered name still names the adapter with ``fingerprint``."""
        return any(r.fingerprint == fingerprint for r in self.adapters.values())

    def resolve(self, model: str) -> LoraRef | None:
        return self.adapters.get(model)

    def cards(self) -> list[dict[str, object]]:
        """/v1/models entries: one per adapter, its base as parent."""
        return [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "root": ref.path,
                "parent": self.base_name,
            }
            for name, ref in self.adapters.items()
        ]


def _already(name: str) -> InvalidRequest:
    return InvalidRequest(
        f"the LoRA adapter {name!r} is already loaded; unload it first", param="lora_name"
    )
