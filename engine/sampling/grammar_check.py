"""Is a compiled grammar's language empty? Two checks, run once per compile.

A grammar no output satisfies (``{"$ref": "#"}``, a definition that must contain itself
with no base case) compiles without complaint, and its matcher then allows no token at
all, or only an unending recursion. Sampling under such a mask has nothing to pick, so
every process refuses the grammar where it compiles it (``GrammarCache.compile_now``):
the frontend answers 400 before any worker sees the request.

- ``unproductive_root``: the source grammar's rules as data (xgrammar's serialized
  form), and the least fixpoint of "this rule can derive some finite string". The root
  rule outside that set has an empty language, whatever the vocabulary.
- ``first_token_allowed``: a fresh matcher's token bitmask. No token allowed (stop
  tokens included) means no output can even start with this vocabulary.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# xgrammar's serialized grammar (the format 0.2.8 writes, "v16"): every expression is
# [type, n, n data ints] in ``grammar_expr_data``, starting at ``grammar_expr_indptr``;
# a rule is [name, body expression, lookahead expression, ...].
SERIALIZED_VERSION = "v16"
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _TAGS, _REPEAT = range(9)


class _Rules:
    """The rules and expressions of one serialized grammar."""

    def __init__(self, data: dict[str, Any]) -> None:
        flat = data["grammar_expr_data"]
        # expression id -> (type, its data ints); ``grammar_expr_indptr`` holds each
        # expression's start only (its length is its second int)
        self.exprs = [
            (flat[i], flat[i + 2 : i + 2 + flat[i + 1]]) for i in data["grammar_expr_indptr"]
        ]
        self.names = [rule[0] for rule in data["rules"]]
        self.bodies = [rule[1] for rule in data["rules"]]
        self.root = int(data["root_rule_id"])

    def derives(self, expr: int, productive: list[bool]) -> bool:
        """Can ``expr`` derive a finite string, given which rules are known to?"""
        kind, args = self.exprs[expr]
        if kind == _RULE:
            return productive[args[0]]
        if kind == _SEQUENCE:
            return all(self.derives(e, productive) for e in args)
        if kind == _CHOICES:
            return any(self.derives(e, productive) for e in args)
        if kind == _REPEAT:  # [rule, min, max]
            return args[1] == 0 or productive[args[0]]
        # Bytes, classes, the empty string, tag dispatch (its plain text may end it), and
        # any kind unknown here: productive, so that the check never refuses wrongly.
        return True

    def refs(self, expr: int) -> set[int]:
        """The rules ``expr`` refers to, directly or through its sub-expressions."""
        kind, args = self.exprs[expr]
        if kind in (_RULE, _REPEAT):
            return {args[0]}
        if kind in (_SEQUENCE, _CHOICES):
            return set().union(*(self.refs(e) for e in args))
        return set()


def unproductive_root(grammar: Any) -> list[str] | None:
    """If no finite string derives from ``grammar``'s root rule (an ``xgrammar.Grammar``
    as converted, not a compiled one: that one serializes its automata too, seconds for a
    large schema), the rules none derives from (the root first); else None. Unknown
    serializations (another xgrammar) are not judged."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != SERIALIZED_VERSION:
        logger.warning(
            "grammar serialization %s, not %s: the recursion check is skipped",
            data.get("__VERSION__"),
            SERIALIZED_VERSION,
        )
        return None
    rules = _Rules(data)
    productive = [False] * len(rules.names)
    users: list[list[int]] = [[] for _ in rules.names]  # rule -> the rules that refer to it
    for r, body in enumerate(rules.bodies):
        for q in rules.refs(body):
            users[q].append(r)
    # A worklist: a rule is judged again only when one it refers to turns productive, so
    # each is judged at most once per rule it refers to (not once per pass over them all).
    todo = list(range(len(rules.names)))
    while todo:
        r = todo.pop()
        if not productive[r] and rules.derives(rules.bodies[r], productive):
            productive[r] = True
            todo.extend(users[r])
    if productive[rules.root]:
        return None
    stuck = [rules.names[r] for r in range(len(rules.names)) if not productive[r]]
    return sorted(stuck, key=lambda name: name != rules.names[rules.root])


def first_token_allowed(compiled: Any, vocab_size: int) -> bool:
    """Does a fresh matcher of ``compiled`` allow any token (stop tokens included)?"""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def emptiness(source: Any, compiled: Any, vocab_size: int) -> str | None:
    """Why ``compiled`` admits no output, or None if some output can start. ``source``:
    the ``xgrammar.Grammar`` it was compiled from, or None to skip the recursion check
    (a grammar that is productive by construction)."""
    stuck = unproductive_root(source) if source is not None else None
    if stuck is not None:
        if len(stuck) == 1:
            rules = f"its rule {stuck[0]!r} always needs another copy of itself"
        else:
            names = ", ".join(stuck[:4]) + (", ..." if len(stuck) > 4 else "")
            rules = f"each of its rules {names} always needs another of them"
        return f"it can never be completed: {rules} (a $ref or rule cycle with no base case)"
    if not first_token_allowed(compiled, vocab_size):
        return "no token of the model's vocabulary can start it"
    return None
