"""Exact incremental detokenization, one small state object per request.

The oracle is ``tokenizer.decode(ids, skip_special_tokens=s)`` of a Hugging Face fast
tokenizer. For a byte-level BPE vocabulary (GPT-2 style ``ByteLevel`` decoder: Qwen2,
Llama 3, ...) that function is, exactly:

    utf8_lossy( concat( token_bytes(i) for i in ids if i is known and not (s and special) ) )

where ``token_bytes`` maps every character of the token through the byte-level alphabet
(or, if any character is outside it, takes the token's own UTF-8 bytes), and
``utf8_lossy`` replaces each maximal invalid subsequence with one U+FFFD.

So the per-request state is a single UTF-8 decoder fed one token's bytes at a time:
Python's incremental ``utf-8``/``replace`` decoder follows the same maximal-subpart rule,
emits a character as soon as its last byte is in, emits U+FFFD as soon as a sequence is
known to be invalid (a stray continuation byte never waits), and holds back only a
trailing sequence that could still complete. ``flush`` (at the request's end) renders
that tail as ``decode()`` would. Every emitted piece is therefore a prefix of the final
text and the pieces concatenate to it; cost per token is O(token bytes), independent of
output length.

``transformers`` 5.x ``TokenizersBackend.decode`` ignores ``spaces_between_special_tokens``
for fast tokenizers (only the slow, Python tokenizers honoured it), so it has no effect
here either: matching the oracle exactly means accepting the flag and ignoring it.

Other decoders (SentencePiece ``Metaspace``/``ByteFallback`` vocabularies: Llama 2,
Mistral) use ``WindowedDetokenizer``: the prefix/read-offset two-decode scheme over a
short window. It is flat in output length but only exact when the decoder is local to the
window, which holds for ordinary text but is not guaranteed for arbitrary id sequences.
"""

from __future__ import annotations

import codecs
import json
import logging
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map, as character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _token_bytes(token: str, alphabet: dict[str, int]) -> bytes:
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        # Same fallback as the tokenizers ByteLevel decoder: a token with a character
        # outside the alphabet (an added token such as "<|a b|>") is taken verbatim.
        return token.encode("utf-8")


class Detokenizer(Protocol):
    """Per-request decode state. ``feed`` returns the new text the token makes final."""

    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TokenTable:
    """Vocabulary-wide, read-only tables shared by every request of a shard.

    ``bytes_for(skip_special)`` is indexed by token id; index ``num_ids`` is a sentinel
    (b"") that ``clamp`` maps unknown ids to, because ``decode()`` drops ids it does not
    know.
    """

    def __init__(self, tokenizer: Any) -> None:
        backend = tokenizer.backend_tokenizer
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self._tokenizer = tokenizer
        added = backend.get_added_tokens_decoder()
        self.num_ids = max([backend.get_vocab_size(with_added_tokens=True), *added]) + 1
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._texts: dict[int, str] = {}
        if not self.byte_level:
            logger.info("decoder %s is not ByteLevel: windowed detokenization", decoder)
            return
        alphabet = _byte_level_alphabet()
        table: list[bytes] = []
        for i in range(self.num_ids):
            token = backend.id_to_token(i)
            table.append(b"" if token is None else _token_bytes(token, alphabet))
        table.append(b"")
        self._with_special = table
        self._skip_special = [b"" if i in self.special_ids else t for i, t in enumerate(table)]
        self._whole_with = [_whole_text(b) for b in self._with_special]
        self._whole_skip = [_whole_text(b) for b in self._skip_special]

    def clamp(self, token_ids: np.ndarray) -> np.ndarray:
        """Map ids outside the vocabulary to the sentinel index (they decode to nothing)."""
        bad = (token_ids < 0) | (token_ids >= self.num_ids)
        return np.where(bad, self.num_ids, token_ids) if bad.any() else token_ids

    def bytes_for(self, skip_special: bool) -> list[bytes]:
        assert self.byte_level
        return self._skip_special if skip_special else self._with_special

    def whole_texts_for(self, skip_special: bool) -> list[str | None]:
        """Per id: the token's text if its bytes are complete UTF-8 on their own, else None."""
        assert self.byte_level
        return self._whole_skip if skip_special else self._whole_with

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw bytes (specials kept); its text's UTF-8 for non-byte-level BPE."""
        if self.byte_level:
            return self._with_special[min(max(token_id, 0), self.num_ids)]
        return self.token_text(token_id).encode()

    def token_text(self, token_id: int) -> str:
        """One token's own text for logprobs: ``decode([id])`` with specials kept."""
        text = self._texts.get(token_id)
        if text is None:
            if self.byte_level:
                raw = self._with_special[min(max(token_id, 0), self.num_ids)]
                text = raw.decode("utf-8", "replace")
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def new_stream(self, skip_special_tokens: bool) -> Detokenizer:
        if self.byte_level:
            return ByteLevelDetokenizer(
                self.bytes_for(skip_special_tokens), self.whole_texts_for(skip_special_tokens)
            )
        return WindowedDetokenizer(self._tokenizer, skip_special_tokens)


def _whole_text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ByteLevelDetokenizer:
    """Exact for byte-level BPE (see the module docstring).

    Fast path: while the UTF-8 decoder holds no partial sequence, a token whose bytes are
    complete UTF-8 on their own (most tokens) decodes to its precomputed text, which is
    exactly what the decoder would return. Other tokens go through the decoder.
    """

    __slots__ = ("_decoder", "_partial", "_table", "_whole")

    def __init__(self, table: list[bytes], whole: list[str | None]) -> None:
        self._table = table
        self._whole = whole
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = False  # the decoder holds bytes of an unfinished character

    def feed(self, token_id: int) -> str:
        if not self._partial:
            text = self._whole[token_id]
            if text is not None:
                return text
        text = self._decoder.decode(self._table[token_id])
        self._partial = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        self._partial = False
        return self._decoder.decode(b"", True)


class WindowedDetokenizer:
    """Prefix/read-offset incremental decode for non-byte-level decoders.

    ``ids[prefix:read]`` decoded is text already emitted; new text is what decoding
    ``ids[prefix:]`` adds to it, held back while it ends in U+FFFD (an incomplete byte
    sequence may still complete). The window is re-anchored after every emission so
    each step decodes a handful of tokens whatever the output length.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tok")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _text(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        return str(self._tok.decode(ids, skip_special_tokens=self._skip)) if ids else ""

    def _advance(self, final: bool) -> str:
        before = self._text(self._prefix, self._read)
        after = self._text(self._prefix)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 64:  # keep memory flat too: ids before the window are done
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return after[len(before) :]

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)
