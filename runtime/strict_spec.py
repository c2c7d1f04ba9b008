"""Strict decoding of a process's settings: the field that does not fit is named.

``decode_spec`` takes the JSON-shaped ``settings`` of a ``ProcessSpec`` and a msgspec
Struct or dataclass: a field the record does not know, one that is missing, or one of the
wrong type raises ``SpecError`` naming it; ``exit_on_bad_spec`` turns that into exit status
``EXIT_BAD_SPEC`` at a process's startup, which the launcher reports and does not restart
(a restart would refuse the same spec). Torch-free: the frontend decodes its spec here too.

NOTE: every field travels, defaults included: a setting one side added and the other does
not know is an error, never a value silently dropped or silently defaulted.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any, TypeVar

import msgspec

logger = logging.getLogger(__name__)

EXIT_BAD_SPEC = 78  # EX_CONFIG (sysexits.h): the process was configured wrongly

T = TypeVar("T")


class SpecError(ValueError):
    """A worker's settings do not match its spec; the message names the field."""


# NOTE: here, not with EngineWorkerSpec in runtime/worker_spec.py: a shard is torch-free.
class DetokWorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A detokenizer shard's settings."""

    log_level: str
    model: str  # checkpoint directory: the tokenizer


def encode_spec(spec: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(spec)


def decode_spec(raw: dict[str, Any], kind: type[T]) -> T:
    """``raw`` as a ``kind``; ``SpecError`` naming the first field that does not fit."""
    _check_fields(raw, kind, "settings")
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as e:
        raise SpecError(f"{kind.__name__}: {e}") from None


def exit_on_bad_spec(raw: dict[str, Any], kind: type[T]) -> T:
    """``decode_spec``, or log why and exit with ``EXIT_BAD_SPEC`` (a worker's startup)."""
    try:
        return decode_spec(raw, kind)
    except SpecError as e:
        logger.critical("refusing my spec: %s", e)
        raise SystemExit(EXIT_BAD_SPEC) from None


def _check_fields(raw: object, kind: Any, path: str) -> None:
    """Exactly ``kind``'s fields, recursively into dataclasses, which msgspec checks less
    strictly than Structs (it ignores unknown keys and fills in defaults). An optional
    record (``X | None``) is checked as ``X`` when present."""
    args = typing.get_args(kind)
    if raw is not None and len(args) == 2 and type(None) in args:
        kind = next(a for a in args if a is not type(None))
    if not isinstance(kind, type):
        return
    if issubclass(kind, msgspec.Struct):
        names = {f.name: f.type for f in msgspec.structs.fields(kind)}
    elif dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        names = {f.name: hints[f.name] for f in dataclasses.fields(kind)}
    else:
        return
    if not isinstance(raw, dict):
        return  # msgspec names the type error
    for key in raw:
        if key not in names:
            raise SpecError(f"{kind.__name__}: unknown field `{key}` at `{path}.{key}`")
    for name, typ in names.items():
        if name not in raw:
            raise SpecError(f"{kind.__name__}: missing field `{name}` at `{path}.{name}`")
        _check_fields(raw[name], typ, f"{path}.{name}")
