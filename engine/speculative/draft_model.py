"""A draft model as proposer: a smaller checkpoint of the same vocabulary, run greedily.

It keeps its own ``ModelRunner`` (its own weights and KV pool, prefix caching off: its
blocks are never published) and one ``Sequence`` per request mirroring the target's
tokens. Each ``propose`` first rolls each mirror back to the longest prefix it shares
with the target's tokens (by length: the KV past it is simply overwritten later), runs
the tokens it lacks in one batched prefill, then decodes k greedy drafts.
"""

from __future__ import annotations

from dataclasses import replace

from engine.build import build_engine
from engine.errors import NoFreeBlocks
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.speculative.proposer import Proposer


class DraftModelProposer(Proposer):
    def __init__(self, target: ModelRunner, model: str) -> None:
        config = replace(
            target.config,
            model=model,
            speculative=None,
            enable_prefix_caching=False,
            large_batch_gemm=False,
            weights_fd=None,  # the host's segment holds the target's weights, not the draft's
            # The draft's KV is its own business: never offered to the host's tiers.
            kv_offload_fd=None,
            kv_offload_nbytes=0,
            kv_offload_dir=None,
            max_loras=0,  # the draft proposes from its base weights, whatever the adapter
        )
        draft = build_engine(config)
        self.runner, self.kv = draft.runner, draft.kv
        if self.runner.model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError(
                f"draft model {model}: vocabulary of {self.runner.model_config.vocab_size} "
                f"tokens, the target's has {target.model_config.vocab_size}"
            )
        self._mirrors: dict[int, Sequence] = {}
        self._synced: dict[int, int] = {}  # rid -> target output tokens the mirror has seen

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        try:
            return self._propose(seqs, ks)
        except NoFreeBlocks:  # its pool is full: start the mirrors over, no drafts now
            for rid in list(self._mirrors):
                self.release(rid)
            return [[] for _ in seqs]

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        mirrors = [self._sync(seq) for seq in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        # Every mirror has all its tokens but the newest computed after this prefill.
        behind = [(m, m.num_uncomputed_tokens - 1) for m in mirrors if m.num_uncomputed_tokens > 1]
        if behind:
            self.runner.prefill(behind)
        live = list(range(len(seqs)))
        for step in range(max(ks, default=0)):
            live = [i for i in live if ks[i] > step]
            if not live:
                break
            logits = self.runner.decode([mirrors[i] for i in live])
            for i, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
                mirrors[i].output_ids.append(token)  # its KV is computed next step
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of ``seq``, its tokens set to the target's, KV kept where they agree."""
        m = self._mirrors.get(seq.rid)
        if m is None:
            m = Sequence(
                rid=seq.rid, prompt_ids=list(seq.prompt_ids), block_size=self.runner.block_size
            )
            self._mirrors[seq.rid] = m
        out, mine = seq.output_ids, m.output_ids
        # The target's output only grows: what the mirror saw of it last time still holds;
        # past that, the mirror holds its own drafts, kept while they match.
        same = self._synced.get(seq.rid, 0)
        while same < min(len(out), len(mine)) and out[same] == mine[same]:
            same += 1
        m.output_ids = list(out)
        self._synced[seq.rid] = len(out)
        m.num_computed_tokens = min(m.num_computed_tokens, len(m.prompt_ids) + same)
        m.num_computed_tokens = min(m.num_computed_tokens, m.num_tokens - 1)
        return m

    def release(self, rid: int) -> None:
        self._synced.pop(rid, None)
        m = self._mirrors.pop(rid, None)
        if m is not None:
            self.kv.free_blocks(m)
