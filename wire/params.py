"""A request's options, split by who needs them: the engine's ``SamplingParams`` and
the detokenizer's ``DetokParams``.

Both are msgspec structs, so they cross process boundaries as plain data (msgpack),
never as pickled objects.
"""

from __future__ import annotations

import enum
import hashlib

import msgspec


class GrammarKind(enum.StrEnum):
    """What a ``GrammarSpec.text`` holds."""

    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; ``text`` is empty
    REGEX = "regex"
    CHOICE = "choice"  # a JSON list of the allowed strings
    EBNF = "ebnf"  # a GBNF/EBNF grammar whose start rule is ``root``


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on a request's output, as the frontend validated it.

    Plain data: every worker compiles it itself (and caches the result by ``key``), so
    the spec, not a compiled grammar, is what crosses the P->D boundary and recovery.
    """

    kind: GrammarKind
    text: str = ""

    @property
    def key(self) -> str:
        """A stable name for the compiled grammar (the same in every process)."""
        digest = hashlib.blake2b(f"{self.kind}\0{self.text}".encode(), digest_size=16)
        return digest.hexdigest()


class LoraRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The LoRA adapter a request runs under, as the frontend's registry names it.

    Plain data: every worker that runs the request loads the adapter itself from ``path``
    (``engine/checkpoint/lora_loader.py``) and checks it still has ``fingerprint`` (a
    digest of its config and weights), which also salts the request's prefix-block
    hashes, so no KV computed under one adapter serves another or the base.
    """

    name: str
    path: str
    fingerprint: str

    @property
    def salt(self) -> bytes:
        return b"lora:" + self.fingerprint.encode()


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (n > 1, best_of).

    Choice 0 keeps ``seed``, so ``n=1`` and the first of ``n`` choices agree; the others
    get a splitmix64 mix of (seed, index), a signed 64-bit value like any user seed.
    """
    if index == 0:
        return seed
    z = ((seed & _MASK64) + index * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


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
    - ``lora``: the adapter the model runs with for this request (prefill and decode).
    - ``grammar``: every output token, the first (sampled by prefill) included, must keep
      the output a prefix of the grammar's language; reaching its end stops the request.
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
    grammar: GrammarSpec | None = None
    # The LoRA adapter the request runs under (None: the base model). Here, not beside
    # the request, so it travels wherever the sampling options do: the KV handoff, recovery.
    lora: LoraRef | None = None

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


class ReasoningMode(enum.IntEnum):
    """Whether, and from where, the detokenizer splits reasoning from the answer
    (``--reasoning-parser``; ``detokenizer/reasoning.py``)."""

    OFF = 0  # the output is all answer
    AT_START = 1  # a <think> block the output opens at its start is reasoning
    OPEN = 2  # the prompt opened the block: the output starts inside it


class DetokParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The detokenizer's half of a request's options."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # An engine stop on one of these reports the token as stop_reason; on EOS it is None.
    stop_token_ids: tuple[int, ...] = ()
    # Reasoning goes to TextDelta.reasoning; stop strings then see only the answer.
    reasoning: ReasoningMode = ReasoningMode.OFF
    # Speculation's per-request counts (TextDelta.drafted_tokens/accepted_tokens), summed
    # over the tokens the client receives: the client opted in.
    count_drafts: bool = False
