"""A request as the engine sees it: tokens, KV blocks, and how far KV is computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.block_allocator import block_hashes
from engine.sampling.grammar import GrammarState
from wire.params import SamplingParams
from wire.records import Finish

if TYPE_CHECKING:
    from engine.kv.tiers.disk_load import InFlight


@dataclass
class Sequence:
    """One request's tokens and KV bookkeeping.

    NOTE: ``num_computed_tokens`` counts positions of ``all_ids`` whose KV is in the pool;
    ``block_table`` always covers at least that many positions. During decode the newest
    output token is the only one not yet computed. With prefix caching the first
    ``num_cached_tokens`` of them were found in the pool, not computed here; the blocks
    holding them may be shared with other sequences and are never written (every write
    goes to positions >= ``num_computed_tokens``, in blocks of this sequence's own).
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
    # Prefix caching: tokens reused at the last prefix lookup (reported to the client),
    # whether that lookup was counted in the hit-rate stats, the chained hashes of the
    # leading full blocks of ``all_ids`` computed so far (a pure function of the tokens,
    # so they survive a preemption), and what salts the chain.
    num_cached_tokens: int = 0
    prefix_queried: bool = False
    block_hashes: list[int] = field(default_factory=list)
    hash_extra: bytes | None = None
    # The 128-bit keys of the same blocks in the KV tiers beyond the pool
    # (engine/kv/tiers/keys.py), computed only when tiers are on.
    tier_keys: list[bytes] = field(default_factory=list)
    # Tier loads in flight for this sequence (``engine.kv.tiers.disk_load.InFlight``):
    # it is parked, its prefix not settled, until ``KVPool.reuse_prefix`` settles it.
    tier_load: InFlight | None = None
    # ``sampling.grammar``'s matcher, built when the sequence is first sampled (its
    # compile may still be running before that); it has accepted every output token.
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        # KV computed under an adapter is that adapter's: its blocks hash apart.
        if self.hash_extra is None and self.sampling.lora is not None:
            self.hash_extra = self.sampling.lora.salt

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def newest_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_span(self, start: int, n: int) -> list[int]:
        """``all_ids[start : start + n]`` without concatenating prompt and output."""
        p = len(self.prompt_ids)
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        if start >= p:
            return self.output_ids[start - p : start - p + n]
        return self.prompt_ids[start:] + self.output_ids[: start + n - p]

    def blocks_needed(self, n_more_tokens: int) -> int:
        """Blocks to add so KV for ``n_more_tokens`` beyond the computed ones fits."""
        total = self.num_computed_tokens + n_more_tokens
        return max(0, -(-total // self.block_size) - len(self.block_table))

    def full_block_hashes(self, n: int) -> list[int]:
        """Hashes of the first ``n`` full blocks of ``all_ids``, extending ``block_hashes``."""
        have, bs = len(self.block_hashes), self.block_size
        if have < n:
            lo, hi, p = have * bs, n * bs, len(self.prompt_ids)
            assert hi <= self.num_tokens, f"rid {self.rid}: block {n - 1} is not full"
            tokens = self.prompt_ids[lo:hi] + self.output_ids[max(0, lo - p) : max(0, hi - p)]
            parent = self.block_hashes[-1] if have else None
            self.block_hashes += block_hashes(tokens, bs, self.hash_extra, parent=parent)
        return self.block_hashes[:n]

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
