"""Role: what a pdserve process does, the one spelling of it in the code base.

A role is written three ways, all derived here:
    its value      ``"prefill"``: process specs, logs, ``/health``, ``/metrics`` labels
    ``letter``     ``"p"``: one end of a ring name (``wire/ring_names.py``)
    ``table_code`` ``1``: the byte a load-table row stores (``transport/load_table.py``);
                   0 there is a slot no worker has claimed, read as no role (None)
and a process's name is ``role.worker_name(index)`` (``prefill-0``). ``/health`` says
``detokenizer`` for a shard (``health_label``), as it always has.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    FRONTEND = "frontend"
    PREFILL = "prefill"
    DECODE = "decode"
    DETOK = "detok"
    COLOCATED = "colocated"
    GATEWAY = "gateway"  # a node's end of the rings whose other end is on another host

    @property
    def letter(self) -> str:
        return _LETTERS[self]

    @property
    def table_code(self) -> int:
        """The load-table byte of an engine worker's row (frontends and shards have none)."""
        assert self.is_engine, f"{self} has no load-table row"
        return _TABLE_CODES[self]

    @property
    def is_engine(self) -> bool:
        """Does it run a model (and own a load-table row)?"""
        return self in _TABLE_CODES

    @property
    def health_label(self) -> str:
        """The role as ``/health`` reports it: a shard is a ``detokenizer`` there (its
        public name, kept for clients), ``detok`` everywhere else."""
        return "detokenizer" if self is Role.DETOK else self.value

    @property
    def sort_key(self) -> int:
        """Order of listings (``/health``): frontend, prefill, decode, co-located, shards."""
        return _ORDER.index(self)

    def worker_name(self, index: int) -> str:
        return f"{self.value}-{index}"

    @classmethod
    def from_letter(cls, letter: str) -> Role:
        try:
            return _BY_LETTER[letter]
        except KeyError:
            raise ValueError(f"no role has the letter {letter!r}") from None

    @classmethod
    def from_table_code(cls, code: int) -> Role | None:
        """The role a load-table byte names, None for 0 (unclaimed); ValueError if foreign."""
        if code == 0:
            return None
        try:
            return _BY_CODE[code]
        except KeyError:
            raise ValueError(f"no role has the load-table code {code}") from None


# NOTE: the stored codes are part of the load table's layout: never renumber them.
_TABLE_CODES = {Role.PREFILL: 1, Role.DECODE: 2, Role.COLOCATED: 3}
_LETTERS = {
    Role.FRONTEND: "f",
    Role.PREFILL: "p",
    Role.DECODE: "d",
    Role.DETOK: "k",
    Role.COLOCATED: "c",
    Role.GATEWAY: "g",
}
_BY_LETTER = {letter: role for role, letter in _LETTERS.items()}
_BY_CODE = {code: role for role, code in _TABLE_CODES.items()}
ENGINE_ROLES = tuple(_TABLE_CODES)
_ORDER = (Role.FRONTEND, Role.PREFILL, Role.DECODE, Role.COLOCATED, Role.DETOK, Role.GATEWAY)
