"""A request as the engine sees it: tokens, KV blocks, and how far KV is computed."""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.params import SamplingParams
from wire.records import Finish


@dataclass
class Sequence:
    """One request's tokens and KV bookkeeping.

    NOTE: ``num_computed_tokens`` counts positions of ``all_ids`` whose KV is in the pool;
    ``block_table`` always covers at least that many positions. During decode the newest
    output token is the only one not yet computed.
    """

    rid: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_size: int = 16
    finish: Finish = Finish.NONE
    # Per output token: the sampled token's logprob, and the top-N (id, logprob) pairs.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def blocks_needed(self, n_more_tokens: int) -> int:
        """Blocks to add so KV for ``n_more_tokens`` beyond the computed ones fits."""
        total = self.num_computed_tokens + n_more_tokens
        return max(0, -(-total // self.block_size) - len(self.block_table))

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
