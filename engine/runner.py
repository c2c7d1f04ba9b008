"""The model runner both worker pools share: weights, batched forward, sampling.

Who calls what:
- ``engine/build.py`` assembles the runner (weights, adapters, grammars, the attention
  backend) and gives it the engine's KV pool (``use_pool``);
- a scheduler (prefill worker, decode worker, or ``colocated.llm.LLM``) owns ``Sequence``
  objects and decides each step's batch; it manages their blocks through the engine's
  KV pool (``engine/kv/pool.py``: prefix reuse, forks, pins, frees);
- ``prefill`` / ``decode`` run one batched forward, write KV into the pool and advance
  ``num_computed_tokens``; ``sample`` picks next tokens; the caller appends them and
  asks ``Stops.check`` (``engine/sampling/stops.py``). ``prefill``/``decode`` publish
  every block they fill, so the next sequence sharing the prefix reuses it;
- ``verify`` / ``commit_verified`` are speculative decoding's forward and its keep;
- a sequence with a grammar (``sampling.grammar``) is sampled only once ``grammar_ready``
  says its grammar is compiled; ``sample`` then masks its row.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.lora_loader import LoraAdapters, in_batch_order, lora_slots
from engine.config import EngineConfig, ModelConfig
from engine.kv.pool import KVPool
from engine.kv.sequence import Sequence
from engine.model.batch_invariance import invariant_meta
from engine.model.causal_lm import CausalLM
from engine.model.torch_backend import StepBatch, TorchBackend
from engine.sampling.grammar import GrammarCache
from engine.sampling.grammar_mask import batch_constraint
from engine.sampling.sampler import SampleOutput, SampleRequest, sample
from engine.weights.linear import decode_rows, prefill_phase
from engine.weights.lora import group_rows, lora_rows

if TYPE_CHECKING:
    from engine.cuda.kernel_path import KernelPath

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model's weights on their device, and what loading them resolved
    (``engine.build.load_weights``)."""

    model: CausalLM
    model_config: ModelConfig
    device: torch.device
    quantization: str
    dtype: torch.dtype  # the activations' and dense weights'
    kv_dtype: torch.dtype  # the KV pool's
    max_model_len: int
    # What this process held on the GPU before this engine: not part of its share.
    cuda_baseline_bytes: int


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        backend: TorchBackend,
        kernels: KernelPath | None,
        loras: LoraAdapters | None,
        grammars: GrammarCache,
    ) -> None:
        """A runner over ``loaded``'s weights; ``backend`` runs its torch forwards,
        ``kernels`` (CUDA's Triton path, if taken) the others. It has no pool until
        ``use_pool``: only forwards given a scratch pool run before (the GPU profile)."""
        self.config = config
        self.model = loaded.model
        self.model_config = loaded.model_config
        self.device = loaded.device
        self.quantization = loaded.quantization
        self.dtype, self.kv_dtype = loaded.dtype, loaded.kv_dtype
        self.block_size = config.block_size
        self.max_model_len = loaded.max_model_len
        self.cuda_baseline_bytes = loaded.cuda_baseline_bytes
        self.backend = backend
        self._kernels = kernels
        # Prefill takes decode rows (not graphed; nor batch-invariant: a decode row in a
        # prefill forward runs prefill's kernels).
        self.mixes_batches = kernels is None and not config.deterministic
        self.loras = loras
        self.grammars = grammars  # the sampler masks constrained rows with them
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.kv: KVPool  # set by use_pool

    def use_pool(self, kv: KVPool) -> None:
        """Run on ``kv`` from now on: the pool is final (graphs may hold it)."""
        self.kv = kv
        backend = self.backend
        kv.on_free(lambda seq: backend.forget([seq]))
        if self._kernels is not None:
            kv.on_free(self._kernels.release)
            self._kernels.reset()  # the profiling forwards' sequences are gone
            if self.device.type == "cuda" and not self.config.enforce_eager:
                self._kernels.enable_graphs()

    def prefill(
        self,
        chunks: list[tuple[Sequence, int]],
        pool: torch.Tensor | None = None,
        every_position: bool = False,
    ) -> torch.Tensor:
        """Run the next ``n`` uncomputed tokens of each sequence in one forward.

        Returns float32 logits (len(chunks), vocab) at each chunk's last position, or with
        ``every_position`` at every token of every chunk (sum of n, vocab): scoring a text.
        ``pool``: a pool to use instead of the runner's; its sequences' block tables must
        already cover the chunks (the GPU memory profile runs on a scratch pool this way).
        NOTE: blocks are ensured chunk by chunk; if a later one raises ``NoFreeBlocks``
        the earlier ones keep the blocks they got (they are valid, merely early).
        """
        if self.loras is not None:
            runs = self.loras.groups([seq.sampling.lora for seq, _ in chunks])
            if len(runs) > 1:  # more adapters than slots: served in turns
                parts = [
                    self.prefill([chunks[i] for i in run], pool, every_position) for run in runs
                ]
                return in_batch_order(parts, runs, every_position and [n for _, n in chunks])
        self.backend.forget([seq for seq, _ in chunks])
        for seq, n in chunks:
            if not 0 < n <= seq.num_uncomputed_tokens:
                raise ValueError(
                    f"rid {seq.rid}: cannot prefill {n} of "
                    f"{seq.num_uncomputed_tokens} uncomputed tokens"
                )
            self._ensure_blocks(seq, n, pool)
        spans = [(seq, seq.num_computed_tokens, n) for seq, n in chunks]
        # NOTE: checked for prefill only, where a reused prefix makes it a risk; decode
        # writes at num_computed_tokens, which reuse_prefix leaves in a block of its own.
        # A scratch pool (``pool``) has no allocator: its sequences own their blocks.
        bs = self.block_size
        assert pool is not None or all(
            self.kv.writable(b)
            for seq, start, n in spans
            for b in seq.block_table[start // bs : (start + n - 1) // bs + 1]
        ), "a prefill would write into a shared or cached block"
        tokens = [t for seq, start, n in spans for t in seq.token_span(start, n)]
        logits = self._forward(spans, tokens, False, pool, every_position)
        self._advance(spans, publish=pool is None)
        return logits

    def decode(self, seqs: list[Sequence], pool: torch.Tensor | None = None) -> torch.Tensor:
        """Run each sequence's newest (only uncomputed) token -> float32 logits (B, vocab);
        ``pool`` as for ``prefill``."""
        if self.loras is not None:
            runs = self.loras.groups([seq.sampling.lora for seq in seqs])
            if len(runs) > 1:  # more adapters than slots: served in turns
                parts = [self.decode([seqs[i] for i in run], pool) for run in runs]
                return in_batch_order(parts, runs, [])
        for seq in seqs:
            if seq.num_uncomputed_tokens != 1:
                raise ValueError(
                    f"rid {seq.rid}: decode needs exactly one uncomputed token, "
                    f"has {seq.num_uncomputed_tokens}"
                )
            self._ensure_blocks(seq, 1, pool)
        spans = [(seq, seq.num_computed_tokens, 1) for seq in seqs]
        newest = [seq.newest_token for seq in seqs]
        logits = self._forward(spans, newest, True, pool)
        self._advance(spans, publish=pool is None)
        return logits

    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """Run each sequence's newest token and its drafts in one forward (speculative
        decoding, engine/speculative/) -> float32 logits (sum(len(d) + 1), vocab): a sequence's
        row j predicts the token after its j-th draft (row 0: after its newest token).

        KV is written for every draft, but ``num_computed_tokens`` does not move and no
        block is published: ``commit_verified`` keeps the accepted part.
        NOTE: runs as a decode for the weights (no ``prefill_phase``: the same linear
        kernels as ``decode``), as a batch of several queries per sequence for attention.
        """
        for seq, d in zip(seqs, drafts, strict=True):
            if seq.num_uncomputed_tokens != 1:
                raise ValueError(
                    f"rid {seq.rid}: verify needs exactly one uncomputed "
                    f"token, has {seq.num_uncomputed_tokens}"
                )
            self.kv.ensure_blocks(seq, len(d) + 1)
        spans = [(seq, seq.num_computed_tokens, len(d) + 1) for seq, d in zip(seqs, drafts)]
        tokens = [t for seq, d in zip(seqs, drafts) for t in (seq.newest_token, *d)]
        return self._forward(spans, tokens, False, None, every_position=True, decode_weights=True)

    def commit_verified(self, seq: Sequence, start: int, accepted: int) -> None:
        """After ``verify``: KV of positions ``start`` (the token run then) .. ``start +
        accepted`` is kept; the rest is dropped by length, and blocks past what the next
        step needs go back to the pool. Publishes the blocks filled by kept positions only.

        NOTE: the caller has appended the accepted drafts and the token sampled after them
        to ``seq.output_ids``; that last one is uncomputed, as after ``decode``.
        """
        seq.num_computed_tokens = start + 1 + accepted
        assert seq.num_uncomputed_tokens == 1, seq.num_uncomputed_tokens
        # Blocks past what the next step needs held only rejected drafts.
        self.kv.truncate(seq, -(-(seq.num_computed_tokens + 1) // self.block_size))
        filled = seq.num_computed_tokens // self.block_size > start // self.block_size
        if filled:
            self.kv.cache_full_blocks(seq, start)

    def _ensure_blocks(self, seq: Sequence, n: int, pool: torch.Tensor | None) -> None:
        if pool is None:
            self.kv.ensure_blocks(seq, n)
        else:  # a scratch pool has no allocator: its sequences own their blocks
            assert not seq.blocks_needed(n), "a scratch pool's sequence must own its blocks"

    def _advance(self, spans: list[tuple[Sequence, int, int]], publish: bool) -> None:
        bs = self.block_size
        for seq, start, n in spans:
            seq.num_computed_tokens += n
            if publish and (start + n) // bs > start // bs:  # a block filled up
                self.kv.cache_full_blocks(seq, start)

    def _forward(
        self,
        spans: list[tuple[Sequence, int, int]],
        tokens: list[int],
        is_decode: bool,
        pool: torch.Tensor | None,
        every_position: bool = False,
        decode_weights: bool = False,
    ) -> torch.Tensor:
        kv_pool = self.kv.tensor if pool is None else pool
        for seq, start, n in spans:
            if start + n > self.max_model_len:
                raise ValueError(
                    f"rid {seq.rid}: {start + n} tokens exceed max_model_len {self.max_model_len}"
                )
        slots = lora_slots(self.loras, [seq.sampling.lora for seq, _, _ in spans])
        if self._kernels is not None and not every_position:
            return self._kernels.forward(spans, tokens, is_decode, kv_pool, slots)
        adapters = None
        if slots is not None:  # the torch path groups token rows
            per_token = [s for s, (_, _, n) in zip(slots, spans) for _ in range(n)]
            adapters = group_rows(per_token, self.device)
        # Speculative verification (``decode_weights``): rows attend as decode rows do; and
        # batch-invariant, a prompt's rows too (engine/model/batch_invariance.py).
        deterministic = self.config.deterministic
        as_decode = decode_weights or (deterministic and self.backend.paged_in_place)
        meta = self.backend.prepare_metadata(StepBatch(spans, kv_pool, is_decode, as_decode))
        if deterministic and not self.backend.paged_in_place:
            meta = invariant_meta(meta)  # the torch reference: every row alone
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        last = None
        if not every_position:  # each span's last token's row
            last = torch.tensor(meta.q_lens, device=self.device).cumsum(0) - 1
        try:
            # Verification (``decode_weights``) runs k + 1 rows a sequence on the kernels its
            # sequences' decode step would run, so its rows get that step's bits.
            if is_decode:
                kernels: AbstractContextManager[None] = nullcontext()
            else:
                kernels = decode_rows(len(spans)) if decode_weights else prefill_phase()
            with kernels, lora_rows(adapters):
                return self.model(ids, kv_pool, meta, self.backend, last)
        except BaseException:
            self.backend.step_failed()
            raise

    def capture_decode_graphs(self) -> None:
        """Before a worker that decodes serves (``KernelPath.capture_decode_graphs``)."""
        if self._kernels is not None:
            self._kernels.capture_decode_graphs(self.kv.tensor)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        """Pick each sequence's next token (output position ``len(seq.output_ids)``)."""
        rows = [SampleRequest(s.sampling, s.prompt_ids, s.output_ids) for s in seqs]
        out = sample(logits, rows, self.generator, batch_constraint(self.grammars, seqs))
        if out.token_ids.is_cuda:
            # Every caller reads the sample on the host (token lists, numpy batches):
            # one copy per step, not one sync per element.
            out = SampleOutput(
                out.token_ids.cpu(), out.logprobs.cpu(), out.top_ids.cpu(), out.top_logprobs.cpu()
            )
        return out
