"""A dataclass of plain JSON values that crosses a process boundary as text (a child's
settings, a shared segment's or ring's fd and size): JSON both ways, never pickle."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Self


class JsonSpec:
    """Base of a dataclass whose fields are JSON values: ``to_json`` / ``from_json``.

    A field that JSON does not give back as itself (an enum) is restored by the subclass
    overriding ``from_json``."""

    __slots__ = ()  # a ``slots=True`` dataclass below stays without a ``__dict__``

    def to_json(self) -> str:
        fields: dict[str, Any] = asdict(self)  # type: ignore[call-overload]
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls(**json.loads(text))
