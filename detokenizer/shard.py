"""One detokenizer shard's state machine: tokens in, text deltas out. No I/O.

Who calls what (the shard process, ``detokenizer/worker.py``, is the only caller):
    register(msg)            a request is admitted (always before its tokens, in practice)
    on_tokens(batch, j)      an engine step's tokens; j = decode worker, None = prefill
    abort(rid)               the frontend cancelled the request
    abandon(owner)           frontend ``owner`` died or restarted: its requests have no
                             client any more
    take_outputs()           once per loop iteration: the TextBatch for the frontend and
                             the stop notifications for decode workers

With a reasoning split (``DetokParams.reasoning``, ``detokenizer/reasoning.py``) the text
goes through the splitter before the stop matcher: reasoning leaves in
``TextDelta.reasoning``, and stop strings see only the answer.

A request's first token (from prefill) also says how many prompt tokens the prefix cache
supplied; every delta from then on carries that count (``TextDelta.cached_tokens``).

Tokens are applied strictly in output position order. A token that arrives early (out of
order, or before its request is registered) waits until the gap fills; a token for a
request that already finished is dropped. A finished request's state is dropped at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detokenizer.incremental import Detokenizer, TokenTable
from detokenizer.reasoning import ReasoningSplitter
from detokenizer.stop_strings import StopMatcher
from wire.error_causes import error_message
from wire.params import ReasoningMode
from wire.records import (
    AbortRequest,
    DetokRegister,
    Finish,
    TextBatch,
    TextDelta,
    TokenBatch,
    TokenLogprob,
)
from wire.rids import owner_of

logger = logging.getLogger(__name__)

# Bounds on bookkeeping for requests this shard holds no state for.
_MAX_FINISHED_REMEMBERED = 1 << 16
_MAX_EARLY_REQUESTS = 4096

# The sampled token's logprob and the top-N (ids, logprobs); None when none were sent.
_RawLogprobs = tuple[float, list[int], list[float]] | None


@dataclass(slots=True)
class _Token:
    token_id: int  # as sampled: reported to the client and used to resume elsewhere
    text_id: int  # token_id clamped into the vocabulary: what the text tables index
    finish: int
    source: int | None  # decode worker index, None for the prefill worker
    logprobs: _RawLogprobs
    cached_tokens: int = -1  # on a first token: prompt tokens from the prefix cache
    drafted: int = 0  # TokenBatch.drafted/accepted of the token's row
    accepted: int = 0


@dataclass(slots=True)
class _Request:
    rid: int
    detok: Detokenizer
    feed: Callable[[int], str]  # detok.feed, bound once: it is called per token
    stop: StopMatcher | None
    reasoning: ReasoningSplitter | None
    num_logprobs: int | None
    plain: bool  # no stop strings, logprobs or reasoning split: on_tokens' fast path applies
    next_pos: int = 0
    pending: dict[int, _Token] = field(default_factory=dict)  # position -> early token
    # Output since the last take_outputs():
    text: str = ""
    reasoning_text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish = Finish.NONE
    stop_reason: str | int | None = None
    error: str | None = None  # what the client is told of an ERROR finish
    stop_token_ids: frozenset[int] = frozenset()
    cached_tokens: int | None = None  # known once the first token arrived
    count_drafts: bool = False
    drafted: int = 0  # since the last take_outputs(), over consumed tokens
    accepted: int = 0


class _FifoSet:
    """A set that forgets its oldest members past ``cap`` (bounded memory)."""

    def __init__(self, cap: int) -> None:
        self._items: dict[int, None] = {}
        self._cap = cap

    def add(self, key: int) -> None:
        self._items[key] = None
        if len(self._items) > self._cap:
            del self._items[next(iter(self._items))]

    def discard(self, key: int) -> bool:
        return self._items.pop(key, 0) is None

    def __contains__(self, key: int) -> bool:
        return key in self._items


class DetokShard:
    def __init__(self, tokenizer: Any, table: TokenTable | None = None) -> None:
        # ``table`` lets shards in one process share the (read-only) vocabulary tables.
        self.table = table if table is not None else TokenTable(tokenizer)
        self._reqs: dict[int, _Request] = {}
        self._early: dict[int, dict[int, _Token]] = {}  # rid -> position -> token
        self._finished = _FifoSet(_MAX_FINISHED_REMEMBERED)
        # Stopped by a string on a prefill token: the decode worker is not known yet.
        self._unnotified = _FifoSet(_MAX_FINISHED_REMEMBERED)
        self._dirty: dict[int, _Request] = {}
        self._notify: list[tuple[int, AbortRequest]] = []

    @property
    def num_active(self) -> int:
        return len(self._reqs)

    def register(self, msg: DetokRegister) -> None:
        if msg.rid in self._reqs:
            logger.warning("rid %d registered twice; keeping the first registration", msg.rid)
            return
        self._finished.discard(msg.rid)
        params = msg.params
        detok = self.table.new_stream(params.skip_special_tokens)
        stop = StopMatcher(params.stop, params.include_stop_str_in_output)
        split = ReasoningMode(params.reasoning) != ReasoningMode.OFF
        reasoning = ReasoningSplitter(ReasoningMode(params.reasoning)) if split else None
        plain = (
            not stop.active
            and msg.num_logprobs is None
            and reasoning is None
            and not params.count_drafts
        )
        req = _Request(
            msg.rid,
            detok,
            detok.feed,
            stop if stop.active else None,
            reasoning,
            msg.num_logprobs,
            plain,
            stop_token_ids=frozenset(params.stop_token_ids),
            count_drafts=params.count_drafts,
        )
        self._reqs[msg.rid] = req
        self._replay(req, msg.output_ids)
        for pos, tok in sorted(self._early.pop(msg.rid, {}).items()):
            if msg.rid in self._reqs:
                self._place(req, pos, tok)

    def _replay(self, req: _Request, output_ids: list[int]) -> None:
        """Rebuild state from tokens the client already has: their released text is not
        sent again, but text still held back (partial UTF-8, partial stop) stays held."""
        text_ids = self.table.clamp(np.asarray(output_ids, dtype=np.int64)).tolist()
        for token_id, text_id in zip(output_ids, text_ids, strict=True):
            self._consume(req, _Token(token_id, text_id, 0, None, None))
            if req.finish != Finish.NONE:
                return
        req.text = req.reasoning_text = ""
        req.drafted = req.accepted = 0
        req.ids.clear()
        self._dirty.pop(req.rid, None)

    def abort(self, rid: int) -> None:
        self._early.pop(rid, None)
        req = self._reqs.get(rid)
        if req is None:
            self._finished.add(rid)
            return
        self._finish(req, Finish.ABORT, None)

    def abandon(self, owner: int) -> list[int]:
        """End every request of frontend ``owner`` (``wire/rids.py``), and tell each one's
        decode worker to stop it at its next token (as for a stop string matched on a
        prefill token), so its KV is freed; the rids abandoned."""
        rids = [rid for rid in self._reqs if owner_of(rid) == owner]
        for rid in rids:
            self.abort(rid)
            self._unnotified.add(rid)
        return rids

    def on_tokens(self, batch: TokenBatch, source_decode: int | None) -> None:
        rids = batch.rids.tolist()
        positions = batch.positions.tolist()
        # NOTE: padded embedding rows make ids past the tokenizer's vocabulary samplable;
        # they are reported as sampled and decode to no text (as decode() renders them).
        token_ids = batch.token_ids.tolist()
        text_ids = self.table.clamp(batch.token_ids).tolist()
        finish = batch.finish.tolist()
        with_logprobs = batch.top_ids.shape[1] > 0 or not bool(np.isnan(batch.logprobs).all())
        reqs, dirty = self._reqs, self._dirty
        cached = self._cached_rows(batch, reqs)
        spec = _spec_rows(batch)
        for i, rid in enumerate(rids):
            req = reqs.get(rid)
            # Fast path (most tokens): in order, mid-stream, no stops or logprobs to handle.
            if (
                req is not None
                and req.plain
                and not finish[i]
                and not req.pending
                and positions[i] == req.next_pos
            ):
                req.next_pos += 1
                req.ids.append(token_ids[i])
                req.text += req.feed(text_ids[i])
                dirty[rid] = req
                continue
            raw = _raw_logprobs(batch, i) if with_logprobs else None
            tok = _Token(
                token_ids[i], text_ids[i], finish[i], source_decode, raw, cached.get(i, -1)
            )
            if spec is not None:
                tok.drafted, tok.accepted = spec[0][i], spec[1][i]
            if req is None:
                self._orphan(rid, positions[i], tok)
            elif positions[i] == req.next_pos and not req.pending:
                self._consume(req, tok)
            else:
                self._place(req, positions[i], tok)

    @staticmethod
    def _cached_rows(batch: TokenBatch, reqs: dict[int, _Request]) -> dict[int, int]:
        """Rows reporting a cached prompt count (first tokens): recorded on registered
        requests at once; returned by row for tokens that must wait (parked with them)."""
        col = batch.cached_tokens
        if col is None:
            return {}
        rows = np.flatnonzero(col >= 0)  # a few per batch at most: one column scan
        out = {}
        for i in rows.tolist():
            n = int(col[i])
            req = reqs.get(int(batch.rids[i]))
            if req is not None and req.cached_tokens is None:
                req.cached_tokens = n
            out[i] = n
        return out

    def take_outputs(self) -> tuple[TextBatch | None, list[tuple[int, AbortRequest]]]:
        items = [self._delta(req) for req in self._dirty.values()]
        self._dirty = {}
        notify, self._notify = self._notify, []
        return (TextBatch(items=items) if items else None), notify

    def _orphan(self, rid: int, pos: int, tok: _Token) -> None:
        """A token for a request this shard holds no state for."""
        if tok.source is not None and self._unnotified.discard(rid):
            self._notify.append((tok.source, AbortRequest(rid=rid)))
        if rid in self._finished:
            return
        early = self._early.setdefault(rid, {})
        early[pos] = tok
        if len(self._early) > _MAX_EARLY_REQUESTS:
            dropped = next(iter(self._early))
            logger.warning("rid %d: tokens never registered, dropping them", dropped)
            del self._early[dropped]

    def _place(self, req: _Request, pos: int, tok: _Token) -> None:
        """Apply an out-of-order token, or park it until the gap before it fills."""
        if pos < req.next_pos:
            logger.debug("rid %d: duplicate token at position %d ignored", req.rid, pos)
            return
        req.pending[pos] = tok
        while req.finish == Finish.NONE and req.next_pos in req.pending:
            self._consume(req, req.pending.pop(req.next_pos))

    def _consume(self, req: _Request, tok: _Token) -> None:
        """Apply the token at ``req.next_pos``."""
        if tok.finish == Finish.LOST:  # no token: the frontend resumes it elsewhere
            # Nothing held back is flushed: the shard that takes the request over replays
            # its tokens and holds back the same text.
            self._finish(req, Finish.LOST, None)
            return
        if tok.finish == Finish.ERROR:  # the engine failed the request: the row has no token
            req.text += self._answer(req, req.detok.flush(), final=True, token=False)
            self._dirty[req.rid] = req
            req.error = error_message(tok.token_id)
            self._finish(req, Finish.ERROR, None)
            return
        req.next_pos += 1
        req.ids.append(tok.token_id)
        if req.count_drafts:
            req.drafted += tok.drafted
            req.accepted += tok.accepted
        if tok.cached_tokens >= 0 and req.cached_tokens is None:
            req.cached_tokens = tok.cached_tokens
        if req.num_logprobs is not None and tok.logprobs is not None:
            req.logprobs.append(self._logprob(tok.token_id, tok.logprobs, req.num_logprobs))
        text = req.feed(tok.text_id)
        if tok.finish:
            text += req.detok.flush()
        if req.reasoning is not None:
            text = self._answer(req, text, final=bool(tok.finish), token=True)
        if req.stop is not None:
            text, match = req.stop.feed(text)
            if match is not None:
                req.text += match.text
                self._stop_decode(req, tok)
                self._finish(req, Finish.STOP, match.stop)
                return
            if tok.finish:
                text += req.stop.flush()
        req.text += text
        self._dirty[req.rid] = req
        if tok.finish:
            # The engine stops on stop_token_ids before EOS, so a listed token was the cause.
            reason = tok.token_id if tok.token_id in req.stop_token_ids else None
            self._finish(req, Finish(tok.finish), reason)

    @staticmethod
    def _answer(req: _Request, text: str, final: bool, token: bool) -> str:
        """Split ``text`` (one token's, or a flush's): the reasoning is kept on ``req``,
        the answer returned for the stop matcher."""
        if req.reasoning is None:
            return text
        split = req.reasoning.feed_token if token else req.reasoning.feed
        reasoning, answer = split(text)
        if final:
            more_reasoning, more_answer = req.reasoning.flush()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        req.reasoning_text += reasoning
        return answer

    def _stop_decode(self, req: _Request, tok: _Token) -> None:
        """A stop string matched: tell the decode worker to stop and free the KV."""
        source = tok.source
        if source is None:  # matched on the prefill token; a parked decode token knows j
            source = next((t.source for t in req.pending.values() if t.source is not None), None)
        if source is None:
            self._unnotified.add(req.rid)
        else:
            self._notify.append((source, AbortRequest(rid=req.rid)))

    def _finish(self, req: _Request, reason: Finish, stop_reason: str | int | None) -> None:
        req.finish = reason
        req.stop_reason = stop_reason if reason == Finish.STOP else None
        req.pending.clear()
        del self._reqs[req.rid]
        self._finished.add(req.rid)
        self._dirty[req.rid] = req

    def _logprob(
        self, token_id: int, raw: tuple[float, list[int], list[float]], n: int
    ) -> TokenLogprob:
        text, raw_bytes = self.table.token_text, self.table.token_bytes
        top_ids = raw[1][:n]
        return TokenLogprob(
            token=text(token_id),
            logprob=raw[0],
            top=[(text(t), lp) for t, lp in zip(top_ids, raw[2][:n])],
            token_bytes=raw_bytes(token_id),
            top_bytes=[raw_bytes(t) for t in top_ids],
        )

    def _delta(self, req: _Request) -> TextDelta:
        text, ids, req.text, req.ids = req.text, req.ids, "", []
        reasoning, req.reasoning_text = req.reasoning_text, ""
        drafted, accepted, req.drafted, req.accepted = req.drafted, req.accepted, 0, 0
        logprobs: list[TokenLogprob] | None = None
        if req.num_logprobs is not None:
            logprobs, req.logprobs = req.logprobs, []
        return TextDelta(
            rid=req.rid,
            text=text,
            token_ids=ids,
            finish=int(req.finish),
            stop_reason=req.stop_reason,
            num_output_tokens=req.next_pos,
            logprobs=logprobs,
            error=(req.error or error_message(-1)) if req.finish == Finish.ERROR else None,
            cached_tokens=req.cached_tokens,
            reasoning=reasoning,
            reasoning_tokens=req.reasoning.tokens if req.reasoning is not None else 0,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
        )


def _spec_rows(batch: TokenBatch) -> tuple[list[int], list[int]] | None:
    """The batch's (drafted, accepted) columns as lists, None when no row drafted.

    NOTE: a row whose token is an accepted draft always shares its batch (one step's)
    with its step's first row, which carries a non-zero ``drafted``: one scan decides.
    """
    if batch.drafted is None or batch.accepted is None or not batch.drafted.any():
        return None
    return batch.drafted.tolist(), batch.accepted.tolist()


def _raw_logprobs(batch: TokenBatch, i: int) -> _RawLogprobs:
    logprob = float(batch.logprobs[i])
    if math.isnan(logprob):
        return None
    return logprob, batch.top_ids[i].tolist(), batch.top_logprobs[i].tolist()
