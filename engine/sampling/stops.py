"""When a sequence stops, and when a constrained one may be sampled.

Who calls what: a scheduler appends each sampled token, then asks ``Stops.check`` why the
sequence must stop (``Finish.NONE``: it goes on); before sampling a sequence with a
grammar it asks ``grammar_ready`` (``GrammarCache.prepare`` started the compile on
arrival), so no step waits for a compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.sampling.grammar import GrammarCache, GrammarState
from wire.params import SamplingParams
from wire.records import Finish


class Stoppable(Protocol):
    """What the checks read of a sequence (engine/kv/sequence.py's)."""

    output_ids: list[int]
    sampling: SamplingParams
    grammar: GrammarState | None

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class Stops:
    """A model's stop rules besides each request's own: its EOS tokens and its length."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def check(self, seq: Stoppable) -> Finish:
        """Why ``seq`` must stop after its newest token, or ``Finish.NONE``."""
        assert seq.output_ids, "check runs after a token is appended"
        last = seq.output_ids[-1]
        params = seq.sampling
        if last in params.stop_token_ids:
            return Finish.STOP
        if not params.ignore_eos and last in self.eos_token_ids:
            return Finish.STOP
        if seq.grammar is not None and seq.grammar.terminated:
            return Finish.STOP
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return Finish.LENGTH
        return Finish.NONE


def grammar_ready(grammars: GrammarCache, seq: Stoppable) -> bool:
    """May ``seq`` be sampled: no grammar, or its grammar is compiled.

    Raises ``GrammarError`` if its grammar failed to compile.
    """
    spec = seq.sampling.grammar
    return spec is None or seq.grammar is not None or grammars.ready(spec)
