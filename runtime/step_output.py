"""Collecting one engine step's sampled tokens into per-shard ``TokenBatch`` records.

Both worker pools emit tokens the same way (``emit``: append, check for a stop, add):
each token goes to the detokenizer shard that owns its request, one ``TokenBatch`` per
shard per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.kv.sequence import Sequence
from engine.sampling.sampler import SampleOutput
from wire.error_causes import ErrorCause
from wire.records import Finish, TokenBatch

logger = logging.getLogger(__name__)


@dataclass
class _Columns:
    rids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # row of each token in the SampleOutput


class TokenBatcher:
    """Groups one step's tokens by detokenizer shard.

    Usage per step: ``add(...)`` for each sampled row, then ``batches(sample)`` once.
    """

    def __init__(self) -> None:
        self._by_shard: dict[int, _Columns] = {}

    def add(
        self,
        shard: int,
        rid: int,
        position: int,
        token: int,
        row: int,
        logprob: float,
        finish: Finish,
        cached_tokens: int = -1,
        drafted: int = 0,
        accepted: bool = False,
    ) -> None:
        """``cached_tokens``: on a request's first token, its prompt tokens reused from the
        prefix cache (-1 on every other token). ``drafted``/``accepted``: speculation's
        counts (``TokenBatch``'s columns of those names)."""
        cols = self._by_shard.setdefault(shard, _Columns())
        cols.rids.append(rid)
        cols.positions.append(position)
        cols.token_ids.append(token)
        cols.logprobs.append(logprob)
        cols.finish.append(int(finish))
        cols.cached_tokens.append(cached_tokens)
        cols.drafted.append(drafted)
        cols.accepted.append(accepted)
        cols.rows.append(row)

    def emit(
        self,
        seq: Sequence,
        shard: int,
        token: int,
        row: int,
        logprob: float,
        check_stop: Callable[[Sequence], Finish],
        cached_tokens: int = -1,
        drafted: int = 0,
        accepted: bool = False,
    ) -> Finish:
        """Append a sampled ``token`` to ``seq``, decide whether it ends the request, and
        add it (``row``: its row in the step's ``SampleOutput``). Returns that finish; the
        caller frees a finished request's blocks.

        A token its grammar refuses (the mask allowed none, so the sampler had nothing
        to pick) ends the request: an ERROR row saying so, the token not sent.
        """
        seq.append_token(token)
        position = len(seq.output_ids) - 1
        if seq.grammar is not None and seq.grammar.failed:
            logger.error("rid %d: ended: its grammar refused output token %d", seq.rid, position)
            cause = ErrorCause.NO_ALLOWED_TOKEN
            self.add(shard, seq.rid, position, cause, row, float("nan"), Finish.ERROR)
            return Finish.ERROR
        finish = check_stop(seq)
        self.add(
            shard, seq.rid, position, token, row, logprob, finish, cached_tokens, drafted, accepted
        )
        return finish

    def end(self, shard: int, rid: int, position: int, finish: Finish) -> None:
        """A row without a token: the request ends (ERROR) or is handed back (LOST)."""
        self.add(shard, rid, position, -1, 0, float("nan"), finish)

    def batches(self, sample: SampleOutput | None) -> dict[int, TokenBatch]:
        """One TokenBatch per shard; top logprobs are gathered from ``sample`` rows."""
        out: dict[int, TokenBatch] = {}
        top_ids = top_lps = None
        if sample is not None and sample.top_ids.shape[1] > 0:
            top_ids = sample.top_ids.numpy().astype(np.int32)
            top_lps = sample.top_logprobs.numpy()
        for shard, c in self._by_shard.items():
            rows = np.asarray(c.rows, dtype=np.int64)
            out[shard] = TokenBatch.build(
                c.rids,
                c.positions,
                c.token_ids,
                c.logprobs,
                c.finish,
                top_ids[rows] if top_ids is not None else None,
                top_lps[rows] if top_lps is not None else None,
                c.cached_tokens,
                c.drafted,
                c.accepted,
            )
        self._by_shard.clear()
        return out
