"""A request's options, split by who needs them: the engine's ``SamplingParams`` and
the detokenizer's ``DetokParams``.

Both are msgspec structs, so they cross process boundaries as plain data (msgpack),
never as pickled objects.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the engine needs to pick each next token and to stop.

    Semantics follow the OpenAI API and vLLM:
    - ``temperature == 0`` means greedy; filters then do not matter.
    - ``top_k <= 0`` disables top-k; ``top_p == 1`` and ``min_p == 0`` disable theirs.
    - ``repetition_penalty`` (multiplicative, over prompt and output tokens),
      ``presence_penalty`` and ``frequency_penalty`` (additive, over output tokens only).
    - ``seed``: the token at output position ``p`` depends only on (seed, p, logits), so a
      seeded request yields the same tokens whatever its batch and whichever worker runs
      it, including after it is resumed on another worker.
    - ``logprobs``: None = none; 0 = the sampled token's logprob; N = plus the top N.
      Logprobs are of the raw model distribution (before temperature and filters).
    - ``max_tokens`` counts output tokens, the first (sampled by prefill) included.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Raise ``ValueError`` naming the offending field if any value is out of range."""
        checks: list[tuple[bool, str]] = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (
                self.seed is None or -(2**63) <= self.seed < 2**63,
                "seed must fit in a signed 64-bit integer",
            ),
            (
                all(0 <= t < vocab_size for t in self.stop_token_ids),
                f"stop_token_ids must be in [0, {vocab_size})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= max_logprobs,
                f"logprobs must be in [0, {max_logprobs}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class DetokParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The detokenizer's half of a request's options."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # An engine stop on one of these reports the token as stop_reason; on EOS it is None.
    stop_token_ids: tuple[int, ...] = ()
