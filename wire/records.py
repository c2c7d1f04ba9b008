"""Every record that crosses a process boundary, and its binary codec.

No record is ever pickled: a record is data, never code. Two encodings:

* ``TokenBatch`` (engine -> detokenizer, the hot path: one record per engine step) is
  columnar: a fixed header followed by numpy columns, decoded with ``np.frombuffer``
  on a private copy of the ring bytes. Cost is flat in batch size per column, not per
  request.
* Everything else is a msgspec struct in a tagged union, msgpack-encoded with
  ``array_like`` (positional fields, small and fast). Control messages are rare.

A ring record is ``kind byte`` + body; ``encode``/``decode`` are the only entry points.

Who sends what (docs/design.md §1 has the processes):
    frontend  -> prefill i   GenerateRequest, AbortRequest, ResetPrefixCache, UnloadLora
    frontend  -> decode j    AbortRequest, ResetPrefixCache, UnloadLora
    frontend  -> detok k     DetokRegister, AbortRequest
    prefill i -> decode j    KVTransfer          (KV is ready in prefill's pool)
    decode j  -> prefill i   KVRelease           (copied or refused: prefill frees blocks)
    prefill i -> decode j    KVPoolHandle        (cuda_ipc only, once at startup)
    prefill i -> detok k     TokenBatch          (first tokens)
    decode j  -> detok k     TokenBatch          (the rest)
    detok k   -> decode j    AbortRequest        (a stop string matched: stop and free)
    detok k   -> frontend    TextBatch
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import msgspec
import numpy as np

from wire.params import DetokParams, SamplingParams


class Finish(enum.IntEnum):
    """Why a request ended; NONE while it is still running."""

    NONE = 0
    STOP = 1  # EOS, a stop token id, or a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # the client went away, or the frontend cancelled it
    ERROR = 4  # an unrecoverable failure; the record carries a message
    # The engine lost what it held of the request (its KV could not be read from the
    # prefill host): the frontend resumes it elsewhere, as after a worker's death. Never
    # reaches a client.
    LOST = 5


class _Msg(msgspec.Struct, array_like=True, tag_field="k", frozen=True):
    pass


class GenerateRequest(_Msg, tag="gen", frozen=True):
    """A request admitted by the frontend, sent to the prefill worker it was routed to.

    ``output_ids`` is non-empty only when a request is resumed after its decode worker
    died: prefill then recomputes KV for prompt + output_ids and samples output
    position ``len(output_ids)``.

    The choices of an ``n > 1`` request share their prompt's KV: the first says how many
    ``forks`` follow it on the same ring, each of those names it in ``fork_of`` and has
    the same prompt. Prefill computes the prompt once and samples every choice from its
    logits (a fork whose leader is gone is an ordinary request).
    """

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    decode_worker: int
    detok_shard: int
    output_ids: list[int] = []
    forks: int = 0
    fork_of: int = -1


class AbortRequest(_Msg, tag="abort", frozen=True):
    rid: int


class ResetPrefixCache(_Msg, tag="reset", frozen=True):
    """Forget every cached prefix (POST /reset_prefix_cache); the worker reports ``epoch``
    in its load-table row once done (``WorkerLoad.prefix_reset_epoch``)."""

    epoch: int


class UnloadLora(_Msg, tag="unlora", frozen=True):
    """The frontend unregistered the LoRA adapter with this fingerprint
    (POST /v1/unload_lora_adapter): a worker frees its slot now, not at its next load."""

    fingerprint: str


class DetokRegister(_Msg, tag="reg", frozen=True):
    """Opens a request's state in its detokenizer shard, before any token can arrive.

    ``output_ids`` are tokens already streamed to the client (a request re-registered
    after a shard restart): the shard rebuilds its state from them and emits no text for
    them.
    """

    rid: int
    params: DetokParams
    prompt_len: int
    num_logprobs: int | None = None
    output_ids: list[int] = []


class KVTransfer(_Msg, tag="kv", frozen=True):
    """KV for ``num_tokens`` positions of ``rid`` is pinned in prefill's blocks ``src_blocks``.

    Carries everything the decode worker needs to continue the request: the tokens the
    KV covers are ``(prompt_ids + output_ids)[:num_tokens]``; the last output token has
    been sampled but not yet run through the model. ``block_hashes`` (prefix caching) are
    the chained hashes of the ``num_tokens // block_size`` full blocks of those tokens, as
    prefill computed them: decode looks them up to copy only the blocks it lacks.
    """

    rid: int
    prefill_worker: int
    src_blocks: list[int]
    num_tokens: int
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: SamplingParams
    detok_shard: int
    block_hashes: list[int] = []


class KVRelease(_Msg, tag="kvrel", frozen=True):
    """Decode no longer needs prefill's blocks for ``rid`` (copied, refused or aborted)."""

    rid: int
    accepted: bool


class KVPoolHandle(_Msg, tag="kvpool", frozen=True):
    """Prefill -> decode, once at startup for the ``cuda_ipc`` backend: how to map the pool.

    ``handle`` is the opaque output of ``transport.kv_backends.CudaIpcExporter.handle()``.
    """

    prefill_worker: int
    handle: bytes


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """A sampled token's text and logprob, and its top-N alternatives.

    ``token_bytes``/``top_bytes`` are the tokens' raw UTF-8 bytes: a token that holds part
    of a character has text with U+FFFD but exact bytes (OpenAI's chat ``bytes`` field).
    """

    token: str
    logprob: float
    top: list[tuple[str, float]] = []
    token_bytes: bytes = b""
    top_bytes: list[bytes] = []


class TextDelta(msgspec.Struct, array_like=True, frozen=True):
    """New text of one request since its previous delta.

    ``token_ids`` are the output tokens this delta covers; ``text`` may lag them while a
    partial UTF-8 sequence or a possible stop-string prefix is held back.
    ``stop_reason`` is the matched stop string or stop token id when finish is STOP.
    With a reasoning split (``DetokParams.reasoning``), ``text`` is the answer and
    ``reasoning`` the reasoning; ``reasoning_tokens`` counts, so far, the output tokens
    that wrote the reasoning block (its tags included).
    ``drafted_tokens``/``accepted_tokens`` (``DetokParams.count_drafts`` only, else 0):
    drafts speculation verified for the request, and the accepted ones among the tokens
    of this delta, both since the previous delta (the frontend sums them). A draft
    accepted past a stop is counted drafted, not accepted: it is not in the output.
    """

    rid: int
    text: str
    token_ids: list[int]
    finish: int = 0
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # Prompt tokens whose KV came from the prefix cache, once the first token is out.
    cached_tokens: int | None = None
    reasoning: str = ""
    reasoning_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class TextBatch(_Msg, tag="text", frozen=True):
    items: list[TextDelta]


Control = (
    GenerateRequest
    | AbortRequest
    | ResetPrefixCache
    | UnloadLora
    | DetokRegister
    | KVTransfer
    | KVRelease
    | KVPoolHandle
    | TextBatch
)


@dataclass(slots=True, frozen=True)
class TokenBatch:
    """One engine step's new tokens for many requests, as columns.

    Shapes, B = number of requests, K = top logprobs per token (0 if none requested
    by any request in the batch; requests asking fewer than K ignore the tail):
        rids         (B,)   int64
        positions    (B,)   int32   index of the token in the request's output
        token_ids    (B,)   int32
        logprobs     (B,)   float32 NaN when the request asked for no logprobs
        finish       (B,)   int8    Finish value; non-zero ends the request. A row with
                                    ERROR carries no token (token_id an ErrorCause,
                                    < 0): the engine failed the request
        top_ids      (B, K) int32
        top_logprobs (B, K) float32
        cached_tokens (B,)  int32   prompt tokens the prefix cache supplied, on the row of
                                    a request's first token (prefill); -1 on other rows
        drafted      (B,)   uint8   speculation (engine/speculative/): on the first row a decode
                                    step emits for a request, how many drafts that step
                                    verified for it; 0 on every other row
        accepted     (B,)   uint8   1 when the row's token is an accepted draft, else 0
                                    (the token sampled after the accepted run is not)

    NOTE: ``accepted`` is per token, not per step, so that a consumer which cuts a
    request's output (a stop string inside an accepted run) sums only what it kept.
    """

    rids: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    cached_tokens: np.ndarray | None = None  # None reads as all -1 (built without it)
    drafted: np.ndarray | None = None  # None reads as all 0 (no speculation)
    accepted: np.ndarray | None = None  # None reads as all 0

    @property
    def size(self) -> int:
        return int(self.rids.shape[0])

    @classmethod
    def build(
        cls,
        rids: list[int],
        positions: list[int],
        token_ids: list[int],
        logprobs: list[float] | None = None,
        finish: list[int] | None = None,
        top_ids: np.ndarray | None = None,
        top_logprobs: np.ndarray | None = None,
        cached_tokens: list[int] | None = None,
        drafted: list[int] | None = None,
        accepted: list[int] | None = None,
    ) -> TokenBatch:
        b = len(rids)
        # The eight columns are field views of one record array: encode() sends its bytes.
        rows = np.empty(b, _TB_ROW)
        rows["rids"] = rids
        rows["positions"] = positions
        rows["token_ids"] = token_ids
        rows["logprobs"] = logprobs if logprobs is not None else np.nan
        rows["finish"] = finish if finish is not None else 0
        rows["cached_tokens"] = cached_tokens if cached_tokens is not None else -1
        rows["drafted"] = drafted if drafted is not None else 0
        rows["accepted"] = accepted if accepted is not None else 0
        return cls(
            rows["rids"],
            rows["positions"],
            rows["token_ids"],
            rows["logprobs"],
            rows["finish"],
            _no_top(b, _I32) if top_ids is None else top_ids.astype(_I32, copy=False),
            _no_top(b, _F32) if top_logprobs is None else top_logprobs.astype(_F32, copy=False),
            rows["cached_tokens"],
            rows["drafted"],
            rows["accepted"],
        )


_KIND_TOKENS = 1
_KIND_CONTROL = 2
# kind, row layout, B, K; 16 bytes keep the rows 8-aligned.
_TB_HEADER = struct.Struct("<BBxxII4x")
# NOTE: bump with any change to _TB_ROW (and LINK_VERSION, wire/link_records.py: token
# batches cross hosts). A reader refuses another layout rather than misread its rows.
_TB_LAYOUT = 2  # 2: + drafted, accepted (speculation); 0 (the pad byte): before layouts
# One row per request, the eight per-request columns interleaved (32 bytes, aligned):
# decode is ONE np.frombuffer, the columns are field views of it. On the per-step hot
# path the cost is per call, not per byte, so fewer numpy calls is what makes it fast.
_TB_FIELDS = (
    "rids",
    "positions",
    "token_ids",
    "logprobs",
    "finish",
    "drafted",
    "accepted",
    "cached_tokens",
)
_TB_ROW = np.dtype(
    {
        "names": list(_TB_FIELDS),
        "formats": ["<i8", "<i4", "<i4", "<f4", "i1", "u1", "u1", "<i4"],
        "offsets": [0, 8, 12, 16, 20, 21, 22, 24],
        "itemsize": 32,  # bytes 23 and 28..31 spare
    }
)
_NONE_READS_AS = {"cached_tokens": -1, "drafted": 0, "accepted": 0}
_I32, _F32 = np.dtype("<i4"), np.dtype("<f4")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


class RecordError(ValueError):
    """A record's bytes do not decode: a bug or memory corruption, never user input."""


def encode(msg: Control | TokenBatch) -> bytes:
    if isinstance(msg, TokenBatch):
        return _encode_tokens(msg)
    return bytes([_KIND_CONTROL]) + _encoder.encode(msg)


def _encode_tokens(msg: TokenBatch) -> bytes:
    """Header, B rows of ``_TB_ROW``, then top_ids and top_logprobs (B, K) when K > 0."""
    b, k = msg.size, int(msg.top_ids.shape[1]) if msg.top_ids.ndim == 2 else 0
    rows = _shared_rows(msg)
    if rows is None:
        rows, fields = _scratch(b)
        for name, field in zip(_TB_FIELDS, fields, strict=True):
            value = getattr(msg, name)
            field[...] = _NONE_READS_AS[name] if value is None else value  # casts, as build()
    head = _TB_HEADER.pack(_KIND_TOKENS, _TB_LAYOUT, b, k)
    if k == 0:
        return head + rows.tobytes()
    top_ids = np.ascontiguousarray(msg.top_ids, dtype=_I32).tobytes()
    top_logprobs = np.ascontiguousarray(msg.top_logprobs, dtype=_F32).tobytes()
    return b"".join((head, rows.tobytes(), top_ids, top_logprobs))


def decode(buf: bytes | bytearray | memoryview) -> Control | TokenBatch:
    """Decode a record. ``buf`` must be a private copy: arrays returned are views of it."""
    if len(buf) == 0:
        raise RecordError("empty record")
    kind = buf[0]
    if kind == _KIND_CONTROL:
        try:
            return _decoder.decode(memoryview(buf)[1:])
        except msgspec.DecodeError as e:
            raise RecordError(f"bad control record: {e}") from e
    if kind != _KIND_TOKENS:
        raise RecordError(f"unknown record kind {kind}")
    return _decode_tokens(buf)


def _decode_tokens(buf: bytes | bytearray | memoryview) -> TokenBatch:
    if len(buf) < _TB_HEADER.size:
        raise RecordError(f"token batch of {len(buf)} bytes is shorter than its header")
    _, layout, b, k = _TB_HEADER.unpack_from(buf, 0)
    if layout != _TB_LAYOUT:
        raise RecordError(f"token batch of row layout {layout}; this build reads {_TB_LAYOUT}")
    offset = _TB_HEADER.size + b * _TB_ROW.itemsize
    if offset + 8 * b * k != len(buf):
        raise RecordError(f"token batch of {len(buf)} bytes, expected {offset + 8 * b * k}")
    rows = np.frombuffer(buf, _TB_ROW, b, _TB_HEADER.size)
    if k:
        top_ids = np.frombuffer(buf, _I32, b * k, offset).reshape(b, k)
        top_logprobs = np.frombuffer(buf, _F32, b * k, offset + 4 * b * k).reshape(b, k)
    else:
        top_ids, top_logprobs = _no_top(b, _I32), _no_top(b, _F32)
    return TokenBatch(
        rows["rids"],
        rows["positions"],
        rows["token_ids"],
        rows["logprobs"],
        rows["finish"],
        top_ids,
        top_logprobs,
        rows["cached_tokens"],
        rows["drafted"],
        rows["accepted"],
    )


def _shared_rows(msg: TokenBatch) -> np.ndarray | None:
    """The record array all eight columns view (from build() or decode()), else None."""
    # NOTE: TokenBatch is frozen, so columns that share one record array came from
    # build() or decode() together.
    rows = msg.rids.base
    if not isinstance(rows, np.ndarray) or rows.dtype is not _TB_ROW:
        return None
    if rows.shape != msg.rids.shape:
        return None
    others = (
        msg.positions,
        msg.token_ids,
        msg.logprobs,
        msg.finish,
        msg.cached_tokens,
        msg.drafted,
        msg.accepted,
    )
    return rows if all(col is not None and col.base is rows for col in others) else None


_NO_TOP: dict[tuple[int, np.dtype], np.ndarray] = {}
_SCRATCH: dict[int, tuple[np.ndarray, tuple[np.ndarray, ...]]] = {}


def _scratch(b: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """A per-size record array and its field views, reused: tobytes() copies it out."""
    entry = _SCRATCH.get(b)
    if entry is None:
        rows = np.empty(b, _TB_ROW)
        entry = _SCRATCH[b] = (rows, tuple(rows[name] for name in _TB_FIELDS))
    return entry


def _no_top(b: int, dtype: np.dtype) -> np.ndarray:
    """A (b, 0) array; it holds no data, so one per size is shared by every batch."""
    arr = _NO_TOP.get((b, dtype))
    if arr is None:
        arr = _NO_TOP[(b, dtype)] = np.zeros((b, 0), dtype)
    return arr
