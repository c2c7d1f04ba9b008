"""A model's reasoning kept apart from its answer: the ``<think>…</think>`` family.

Models of this family (Qwen3, DeepSeek-R1 and their distillations) write their reasoning
between ``<think>`` and ``</think>`` before the answer. The chat template may open the
block itself (its generation prompt ends in ``<think>``: the frontend sees that and says
so with ``ReasoningMode.OPEN``), or the model opens it as the first thing it writes
(``AT_START``). Everything inside the block is reasoning, everything after ``</think>``
the answer; a ``<think>`` later in the output is answer text, as is the whole of an output
that does not start with one.

``ReasoningSplitter`` is fed the request's text as the detokenizer makes it, in pieces cut
anywhere (a tag may arrive over several tokens, or inside one), and returns (reasoning,
answer) pieces. Like the stop matcher it holds back only what may still turn out to be
part of a tag, plus the whitespace that is layout around the tags (after ``<think>``,
before and after ``</think>``): the pieces of one output, concatenated, are the same
however its text was cut.
"""

from __future__ import annotations

import enum

from wire.params import ReasoningMode

OPEN, CLOSE = "<think>", "</think>"
# ``--reasoning-parser`` names (vLLM's) of the models that write this block. They read
# alike here: whether the block starts open is the prompt's to say, not the parser's.
PARSERS = ("deepseek_r1", "qwen3")


class _State(enum.Enum):
    START = 0  # nothing but whitespace yet: a <think> here opens the block
    REASONING = 1
    ANSWER = 2  # after </think>, or an output that did not open a block


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    __slots__ = (
        "_answer_started",
        "_held",
        "_maybe",
        "_opened",
        "_reasoning_started",
        "_state",
        "tokens",
    )

    def __init__(self, mode: ReasoningMode) -> None:
        assert mode != ReasoningMode.OFF
        self._state = _State.REASONING if mode == ReasoningMode.OPEN else _State.START
        self._held = ""  # text not yet known to be reasoning or answer
        self._reasoning_started = False  # the layout whitespace after <think> is behind us
        self._answer_started = False  # the layout whitespace after </think> is behind us
        self._opened = False  # the output opened the block itself (AT_START)
        # Output tokens that wrote the block, tags included (usage reports them), and
        # those read at the start that join them if a <think> follows.
        self.tokens = 0
        self._maybe = 0

    def feed_token(self, text: str) -> tuple[str, str]:
        """``feed`` for the text of one output token, counting the block's tokens."""
        before = self._state
        out = self.feed(text)
        if before == _State.REASONING:
            self.tokens += 1
        elif before == _State.START and self._state == _State.START:
            self._maybe += 1
        elif before == _State.START and self._opened:  # this token opened the block
            self.tokens += self._maybe + 1
        return out

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that ``text``, the output's next piece, makes final."""
        if not text:
            return "", ""
        self._held += text
        if self._state == _State.START:
            head = self._held.lstrip()
            if head.startswith(OPEN):
                self._state, self._held, self._opened = _State.REASONING, head[len(OPEN) :], True
            elif not head or OPEN.startswith(head):
                return "", ""  # still (whitespace before) a possible opening tag
            else:  # no block: the whole output is the answer, as written
                self._state, self._answer_started = _State.ANSWER, True
        reasoning = self._reasoning() if self._state == _State.REASONING else ""
        answer = self._answer() if self._state == _State.ANSWER else ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """The output has ended: what was held back, where it belongs."""
        held, self._held = self._held, ""
        if self._state == _State.REASONING:
            # Cut short inside the block (max_tokens): a partial tag and the whitespace
            # held before it are reasoning text after all.
            return held, ""
        if self._state == _State.ANSWER and not self._answer_started:
            return "", held.lstrip()  # layout after </think>, and nothing else came
        return "", held  # START: whitespace or a partial <think>, answer text after all

    def _reasoning(self) -> str:
        """Reasoning up to ``</think>`` (then on to the answer), or up to what could
        still begin it; trailing whitespace waits, as it may precede the tag."""
        if not self._reasoning_started:
            self._held = self._held.lstrip()
            if not self._held:
                return ""
            self._reasoning_started = True
        at = self._held.find(CLOSE)
        if at >= 0:
            out, self._held = self._held[:at].rstrip(), self._held[at + len(CLOSE) :]
            self._state = _State.ANSWER
            return out
        keep = partial_suffix(self._held, CLOSE)
        body = self._held[: len(self._held) - keep]
        out = body.rstrip()
        self._held = self._held[len(out) :]
        return out

    def _answer(self) -> str:
        if not self._answer_started:
            self._held = self._held.lstrip()
            if not self._held:
                return ""
            self._answer_started = True
        out, self._held = self._held, ""
        return out
