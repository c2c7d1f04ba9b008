"""The model runner both worker pools share: weights, KV pool, batched forward, sampling.

Who calls what:
- a scheduler (prefill worker, decode worker, or ``colocated.llm.LLM``) owns ``Sequence``
  objects and decides each step's batch;
- ``reuse_prefix`` (prefix caching) points a fresh sequence at the pool's blocks of its
  longest cached prefix; call it before planning the sequence's first chunk;
- ``ensure_blocks`` grows a sequence's block table (``NoFreeBlocks`` leaves it as it was);
  ``prefill`` / ``decode`` call it too, so a caller that pre-allocated pays nothing;
- ``prefill`` / ``decode`` run one batched forward, write KV into the pool and advance
  ``num_computed_tokens``; ``sample`` picks next tokens; the caller appends them and
  asks ``check_stop``; ``free_blocks`` returns a finished sequence's blocks.
- a sequence with a grammar (``sampling.grammar``) is sampled only once
  ``grammar_ready`` says its grammar is compiled (``grammars.prepare`` starts that on
  arrival); ``sample`` then masks its row and ``check_stop`` ends it when the grammar is
  complete.
- ``prefill`` / ``decode`` publish every block they fill (``cache_full_blocks``), so the
  next sequence sharing the prefix reuses it; a caller that writes KV some other way (a
  decode worker importing a transfer) calls ``cache_full_blocks`` itself.
- schedulers and workers see the pool only through the KV interface below
  (``num_free_kv_blocks``, ``acquire_cached``, ``pin_blocks``, ``kv_figures`` ...), never
  through ``allocator``, which tests may inspect.
"""

from __future__ import annotations

import gc
import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.checkpoint.loader import load_weights
from engine.config import EngineConfig, ModelConfig, parse_dtype
from engine.cuda.gpu_memory import gpu_kv_blocks
from engine.cuda.kernels import use_kernels
from engine.kv.block_manager import BlockAllocator, KVFigures
from engine.kv.kv_cache import GpuMemoryError, allocate_kv_pool, check_kv_pool, pool_layout
from engine.kv.sequence import Sequence
from engine.kv.tiers.tiered import open_tiers
from engine.model.attention import AttentionMetadata, DenseDecodeKV
from engine.model.backend import TORCH
from engine.model.causal_lm import CausalLM
from engine.sampling.grammar import GrammarCache
from engine.sampling.grammar_mask import batch_constraint
from engine.sampling.sampler import SampleOutput, SampleRequest, sample
from engine.tokenizer.hf_tokenizer import load_tokenizer
from engine.weights.linear import decode_rows, prefill_phase
from engine.weights.plan import cache_dtype, resolve_quantization
from wire.records import Finish

if TYPE_CHECKING:
    from engine.cuda.kernel_path import KernelPath

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, kv_pool: torch.Tensor | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = torch.device(config.device)
        self.quantization = resolve_quantization(
            config.quantization, Path(config.model), config.device
        )
        self.dtype = parse_dtype(config.dtype, self.model_config.dtype)
        self.kv_dtype = cache_dtype(self.dtype, self.quantization)
        self.block_size = config.block_size
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.eos_token_ids = self.model_config.eos_token_ids
        # What this process held on the GPU before this engine: not part of its share.
        # Garbage first (an earlier engine's cycles): freed later, it would count against us.
        if self.device.type == "cuda":
            gc.collect()
        self.cuda_baseline_bytes = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        )
        self.model = CausalLM(self.model_config, self.max_model_len, self.dtype, self.device)
        gemm_rows = config.gemm_min_rows if config.large_batch_gemm else None
        load_weights(self.model, Path(config.model), self.quantization, gemm_rows)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.grammars = GrammarCache(
            lambda: load_tokenizer(config.model),  # when a grammar first needs it
            self.model_config.vocab_size,
            self.eos_token_ids, model_dir=config.model,
        )  # fmt: skip
        # CPU only: on CUDA gathering is cheap and a second copy of the KV would cost memory.
        self._dense = DenseDecodeKV() if self.device.type == "cpu" else None
        self._kernels: KernelPath | None = None
        if use_kernels(config.attention_backend, self.device.type):
            from engine.cuda.kernel_path import KernelPath  # imports triton: only when used

            self._kernels = KernelPath(self.model, self.model_config, config, self.max_model_len)
        if self.device.type == "cuda":
            # SDPA (the torch attention path) keeps to the flash and memory-efficient
            # kernels: cuDNN's backend has open silent-correctness bugs
            # (pytorch/pytorch#193893: corrupted greedy output for GQA models).
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.kv_pool = self._make_pool(kv_pool)
        if self._kernels is not None:
            self._kernels.reset()  # the profiling forwards' sequences are gone
            if self.device.type == "cuda" and not config.enforce_eager:
                self._kernels.enable_graphs()  # the pool is final: graphs may hold it
        self.allocator = BlockAllocator(int(self.kv_pool.shape[0]))
        # KV beyond the pool (host RAM, disk): offered every registered block, asked on a miss.
        self.tiers = open_tiers(config, self.kv_pool)
        logger.info(
            "%s: %d KV blocks of %d tokens, max_model_len %d, %s weights, %s on %s",
            self.model_config.architecture, self.allocator.num_blocks, self.block_size,
            self.max_model_len, self.quantization, self.dtype, self.device,
        )  # fmt: skip

    def _make_pool(self, kv_pool: torch.Tensor | None) -> torch.Tensor:
        if kv_pool is not None:
            check_kv_pool(kv_pool, self.model_config, self.block_size)
            if kv_pool.dtype != self.kv_dtype or kv_pool.device.type != self.device.type:
                raise ValueError(f"kv_pool must be {self.kv_dtype} on {self.device}")
            return kv_pool
        try:
            num_blocks = self.num_blocks_to_allocate()  # on CUDA: runs a profiling forward
        except torch.cuda.OutOfMemoryError as e:
            raise GpuMemoryError(
                f"the profiling forward (one --chunked-prefill-size chunk, --max-num-seqs "
                f"decode rows) ran out of memory on {self.device}: lower those, or "
                "--max-model-len, or raise --gpu-memory-utilization"
            ) from e
        try:
            return allocate_kv_pool(
                self.model_config, num_blocks, self.block_size, self.kv_dtype, self.device
            )
        except torch.cuda.OutOfMemoryError as e:
            layout = pool_layout(self.model_config, num_blocks, self.block_size, self.kv_dtype)
            nbytes = layout.nbytes
            raise GpuMemoryError(
                f"a KV cache of {num_blocks} blocks ({nbytes / (1 << 30):.2f} GiB) does not "
                f"fit on {self.device}: another process may hold its memory; lower "
                "--gpu-memory-utilization (or --kv-cache-tokens with --kv-transfer shm)"
            ) from e

    def num_blocks_to_allocate(self) -> int:
        """Pool size when the caller passes no pool: explicit, CPU tokens, or GPU memory."""
        wanted = self.config.num_kv_blocks
        if wanted is None:
            if self.device.type != "cuda":
                return -(-self.config.kv_cache_tokens // self.block_size)
            return gpu_kv_blocks(self)
        if self.device.type == "cuda" and self.config.gpu_memory_share is not None:
            # A launched worker with a fixed pool (shm staging): it must fit its share too,
            # or it would take memory from the workers it shares the GPU with.
            fits = gpu_kv_blocks(self)
            if wanted > fits:
                raise GpuMemoryError(
                    f"a KV pool of {wanted} blocks does not fit this worker's GPU share "
                    f"({fits} blocks): lower --kv-cache-tokens or raise "
                    "--gpu-memory-utilization"
                )
        return wanted

    def ensure_blocks(self, seq: Sequence, n: int) -> None:
        """Grow ``seq.block_table`` to hold ``n`` more computed tokens (all or nothing)."""
        assert seq.block_size == self.block_size, "sequence built for another block size"
        need = seq.blocks_needed(n)
        if need:
            seq.block_table.extend(self.allocator.allocate(need))

    def reuse_prefix(self, seq: Sequence, wait: bool = True) -> int:
        """Give a fresh ``seq`` the pool's blocks of its longest cached prefix, as computed.

        Returns the tokens reused (also ``seq.num_cached_tokens``); 0 and no change for a
        sequence that already has blocks, or with prefix caching off. Call it before
        planning the first chunk: it lowers ``seq.num_uncomputed_tokens``.
        NOTE: one token at least stays uncomputed (its logits give the next token) and it
        must land in a block of the sequence's own, never in a shared one: reuse stops at
        the last block boundary before ``num_tokens``, so a fully cached prompt recomputes
        its last block rather than write into a cached one.
        ``wait=False``: a sequence whose blocks come from tier 3 may be left parked
        (``tier_loading``: 0 returned, nothing counted yet); call again on a later step.
        """
        if seq.tier_load is not None:  # parked: settle it once its reads are done
            if not wait and not seq.tier_load.done():
                return 0
            self._settle_tier_load(seq)
        else:
            if not self.config.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
                return 0
            hashes = seq.full_block_hashes((seq.num_tokens - 1) // self.block_size)
            seq.block_table = self.allocator.acquire(hashes)
            if self.tiers is not None and len(seq.block_table) < len(hashes):
                self._load_from_tiers(seq, hashes, wait)
                if seq.tier_load is not None:
                    return 0
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        # A hit ends the lookups (the sequence has blocks now), so hits count once; a miss
        # is looked up again while the sequence waits for blocks, but is one query.
        stats = self.allocator.stats
        stats.hit_tokens += seq.num_cached_tokens
        if not seq.prefix_queried:
            seq.prefix_queried = True
            stats.queried_tokens += seq.num_tokens
        return seq.num_cached_tokens

    def _load_from_tiers(self, seq: Sequence, hashes: list[int], wait: bool) -> None:
        """Extend ``seq``'s pool hits with the tiers' run of the blocks after them (tier-3
        reads may be left in flight in ``seq.tier_load`` when not ``wait``)."""
        assert self.tiers is not None
        alloc = self.allocator

        def allocate(n: int) -> list[int]:  # as many as the pool has room for
            return alloc.allocate(min(n, alloc.num_available))

        first = len(seq.block_table)
        loaded = self.tiers.load(seq, first, len(hashes), allocate, alloc.free, wait)
        self._adopt(seq, hashes, loaded.blocks)
        seq.tier_load = loaded.pending

    def _settle_tier_load(self, seq: Sequence) -> None:
        assert self.tiers is not None and seq.tier_load is not None
        load, seq.tier_load = seq.tier_load, None
        hashes = seq.full_block_hashes((seq.num_tokens - 1) // self.block_size)
        assert load.first == len(seq.block_table), "tier-3 blocks follow the others"
        self._adopt(seq, hashes, self.tiers.settle(load))

    def _adopt(self, seq: Sequence, hashes: list[int], blocks: list[int]) -> None:
        """Append tier-loaded ``blocks`` to ``seq`` and publish them in the pool."""
        first = len(seq.block_table)
        for i, b in enumerate(blocks):
            # A block another sequence registered meanwhile keeps the pool's copy; this
            # one stays private (register's rule), both hold the same KV.
            self.allocator.register(b, hashes[first + i])
        seq.block_table += blocks

    def tier_loading(self, seq: Sequence) -> bool:
        """Is ``seq`` parked while its blocks are read from tier 3?"""
        return seq.tier_load is not None

    def wait_tier_loads(self, seqs: list[Sequence], timeout_s: float) -> None:
        """Block until one of ``seqs``' tier-3 loads is done, or ``timeout_s`` passed: a
        scheduler with nothing else to run waits here rather than spin."""
        loads = [s.tier_load for s in seqs if s.tier_load is not None]
        if loads and not any(x.done() for x in loads):
            loads[0].wait(timeout_s)

    def fork(self, parent: Sequence, child: Sequence, copy_tail: bool) -> None:
        """Give fresh ``child`` (same tokens as ``parent``) the parent's computed KV.

        Full blocks are shared (one more reference each). The partial last block is
        shared too unless ``copy_tail``: then the child, which will write its next token
        there (co-located decode), gets a copy of its own (``NoFreeBlocks`` if none is
        free; ``child`` is then unchanged).
        """
        assert not child.block_table and child.all_ids == parent.all_ids, child.rid
        bs, computed = self.block_size, parent.num_computed_tokens
        blocks = parent.block_table[: -(-computed // bs)]
        tail: list[int] = []
        if copy_tail and computed % bs:
            tail = self.allocator.allocate(1)
            self.kv_pool[tail[0]].copy_(self.kv_pool[blocks[-1]])
            blocks = blocks[:-1]
        self.allocator.share(blocks)
        child.block_table = blocks + tail
        child.num_computed_tokens = computed
        child.num_cached_tokens = computed  # none of it was computed for the child
        child.block_hashes = list(parent.block_hashes)

    def cache_full_blocks(self, seq: Sequence, start: int = 0) -> None:
        """Publish ``seq``'s blocks filled between position ``start`` and its computed end.

        From then on a sequence with the same prefix can ``reuse_prefix`` them. No-op with
        prefix caching off. NOTE: the caller promises those positions' KV is in the pool.
        """
        if not self.config.enable_prefix_caching:
            return
        first, end = start // self.block_size, seq.num_computed_tokens // self.block_size
        if first >= end:
            return
        hashes = seq.full_block_hashes(end)
        for i in range(first, end):
            self.allocator.register(seq.block_table[i], hashes[i])
        if self.tiers is not None:
            self.tiers.offer(seq, first, end)

    def free_blocks(self, seq: Sequence) -> None:
        """Return a sequence's blocks to the pool; its KV is gone (num_computed_tokens = 0)."""
        if self._dense is not None:
            self._dense.forget([seq])
        if self._kernels is not None:
            self._kernels.release(seq)
        if seq.tier_load is not None:  # aborted or preempted while parked
            seq.tier_load.cancel()
            seq.tier_load = None
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.prefix_queried = False  # recomputing it, if ever, starts with a new lookup

    # ---- the KV interface of schedulers and workers (the allocator stays inside) -------

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the whole pool: a sequence needing more can never run here."""
        return self.allocator.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        """Blocks ``ensure_blocks`` can have now: free ones plus evictable cached ones."""
        return self.allocator.num_available

    def acquire_cached(self, hashes: list[int]) -> list[int]:
        """The pool's blocks of the longest prefix of ``hashes``, one reference each taken
        (a decode worker's lookup for handed-off KV; ``reuse_prefix`` is the usual way)."""
        return self.allocator.acquire(hashes)

    def count_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Record a lookup made outside ``reuse_prefix`` in the prefix-cache counters."""
        self.allocator.stats.queried_tokens += queried_tokens
        self.allocator.stats.hit_tokens += hit_tokens

    def pin_blocks(self, ids: list[int]) -> None:
        """Hand a sequence's references on ``ids`` to an outgoing transfer (prefill)."""
        self.allocator.pin(ids)

    def unpin_blocks(self, ids: list[int]) -> None:
        """The transfer's reader is done with ``ids`` (or dead): release them."""
        self.allocator.unpin(ids)

    def watch_prefix_hashes(self) -> None:
        """Journal every prefix-hash change from now on (for a worker's prefix summary)."""
        self.allocator.watch_hashes()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix the pool holds (the tiers are emptied by their owner, see
        ``frontend/engine_link/prefix_reset.py``); the hashes dropped."""
        return self.allocator.forget_hashes()

    def take_prefix_hash_changes(self) -> tuple[list[int], list[int]]:
        """(registered, evicted) hashes since the last call; ``watch_prefix_hashes`` first."""
        return self.allocator.take_hash_changes()

    def kv_figures(self) -> KVFigures:
        return self.allocator.figures()

    def prefill(
        self, chunks: list[tuple[Sequence, int]], pool: torch.Tensor | None = None,
        every_position: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Run the next ``n`` uncomputed tokens of each sequence in one forward.

        Returns float32 logits (len(chunks), vocab) at each chunk's last position, or with
        ``every_position`` at every token of every chunk (sum of n, vocab): scoring a text.
        ``pool``: a pool to use instead of the runner's; its sequences' block tables must
        already cover the chunks (the GPU memory profile runs on a scratch pool this way).
        NOTE: blocks are ensured chunk by chunk; if a later one raises ``NoFreeBlocks``
        the earlier ones keep the blocks they got (they are valid, merely early).
        """
        if self._dense is not None:
            self._dense.forget([seq for seq, _ in chunks])
        for seq, n in chunks:
            if not 0 < n <= seq.num_uncomputed_tokens:
                raise ValueError(f"rid {seq.rid}: cannot prefill {n} of "
                                 f"{seq.num_uncomputed_tokens} uncomputed tokens")  # fmt: skip
            self.ensure_blocks(seq, n)
        spans = [(seq, seq.num_computed_tokens, n) for seq, n in chunks]
        # NOTE: checked for prefill only, where a reused prefix makes it a risk; decode
        # writes at num_computed_tokens, which reuse_prefix leaves in a block of its own.
        # A scratch pool (``pool``) has no allocator: its sequences own their blocks.
        bs = self.block_size
        assert pool is not None or all(
            self.allocator.writable(b) for seq, start, n in spans
            for b in seq.block_table[start // bs : (start + n - 1) // bs + 1]
        ), "a prefill would write into a shared or cached block"  # fmt: skip
        tokens = [t for seq, start, n in spans for t in _token_span(seq, start, n)]
        logits = self._forward(spans, tokens, False, pool, every_position)
        self._advance(spans, publish=pool is None)
        return logits

    def decode(self, seqs: list[Sequence], pool: torch.Tensor | None = None) -> torch.Tensor:
        """Run each sequence's newest (only uncomputed) token -> float32 logits (B, vocab).

        ``pool`` as for ``prefill``.
        """
        for seq in seqs:
            if seq.num_uncomputed_tokens != 1:
                raise ValueError(f"rid {seq.rid}: decode needs exactly one uncomputed token, "
                                 f"has {seq.num_uncomputed_tokens}")  # fmt: skip
            self.ensure_blocks(seq, 1)
        spans = [(seq, seq.num_computed_tokens, 1) for seq in seqs]
        newest = [_newest(seq) for seq in seqs]
        logits = self._forward(spans, newest, True, pool)
        self._advance(spans, publish=pool is None)
        return logits

    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """Run each sequence's newest token and its drafts in one forward (speculative
        decoding, engine/spec/) -> float32 logits (sum(len(d) + 1), vocab): a sequence's
        row j predicts the token after its j-th draft (row 0: after its newest token).

        KV is written for every draft, but ``num_computed_tokens`` does not move and no
        block is published: ``commit_verified`` keeps the accepted part.
        NOTE: runs as a decode for the weights (no ``prefill_phase``: the same linear
        kernels as ``decode``), as a batch of several queries per sequence for attention.
        """
        if self._dense is not None:
            self._dense.forget(list(seqs))  # its rows would miss the drafts' KV
        for seq, d in zip(seqs, drafts, strict=True):
            if seq.num_uncomputed_tokens != 1:
                raise ValueError(
                    f"rid {seq.rid}: verify needs exactly one uncomputed "
                    f"token, has {seq.num_uncomputed_tokens}"
                )
            self.ensure_blocks(seq, len(d) + 1)
        spans = [(seq, seq.num_computed_tokens, len(d) + 1) for seq, d in zip(seqs, drafts)]
        tokens = [t for seq, d in zip(seqs, drafts) for t in (_newest(seq), *d)]
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
        keep = -(-(seq.num_computed_tokens + 1) // self.block_size)
        if len(seq.block_table) > keep:  # blocks that only held rejected drafts
            self.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        if seq.num_computed_tokens // self.block_size > start // self.block_size:
            self.cache_full_blocks(seq, start)

    def _advance(self, spans: list[tuple[Sequence, int, int]], publish: bool) -> None:

        bs = self.block_size
        for seq, start, n in spans:
            seq.num_computed_tokens += n
            if publish and (start + n) // bs > start // bs:  # a block filled up
                self.cache_full_blocks(seq, start)

    def _forward(
        self, spans: list[tuple[Sequence, int, int]], tokens: list[int], is_decode: bool,
        pool: torch.Tensor | None, every_position: bool = False, decode_weights: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        kv_pool = self.kv_pool if pool is None else pool
        for seq, start, n in spans:
            if start + n > self.max_model_len:
                raise ValueError(f"rid {seq.rid}: {start + n} tokens exceed max_model_len "
                                 f"{self.max_model_len}")  # fmt: skip
        if self._kernels is not None and not every_position:
            return self._kernels.forward(spans, tokens, is_decode, kv_pool)
        meta, last = self._metadata(spans, is_decode, kv_pool)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        try:
            # Verification (``decode_weights``) runs k + 1 rows a sequence on the kernels its
            # sequences' decode step would run, so its rows get that step's bits.
            if is_decode:
                kernels: AbstractContextManager[None] = nullcontext()
            else:
                kernels = decode_rows(len(spans)) if decode_weights else prefill_phase()
            with kernels:
                return self.model(ids, kv_pool, meta, TORCH, None if every_position else last)
        except BaseException:
            if self._dense is not None:  # some layers may have extended it, others not
                self._dense.invalidate()
            raise

    def _metadata(
        self, spans: list[tuple[Sequence, int, int]], is_decode: bool, kv_pool: torch.Tensor
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """The step's attention metadata, and the rows of each span's last token."""
        bs, dev = self.block_size, self.device
        positions = [p for _, start, n in spans for p in range(start, start + n)]
        slot_blocks = [
            seq.block_table[p // bs] for seq, start, n in spans for p in range(start, start + n)
        ]
        width = max(len(seq.block_table) for seq, _, _ in spans)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _, _ in spans]
        ctx_lens = [start + n for _, start, n in spans]
        q_lens = [n for _, _, n in spans]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        block_tables = torch.tensor(tables, dtype=torch.long, device=dev)
        layers = self.model_config.num_layers
        blocks = torch.tensor(slot_blocks, dtype=torch.long, device=dev)
        slot_rows = blocks * (layers * 2 * bs) + pos % bs  # layer 0's K row of each token
        decode_fields = (
            self._decode_fields(spans, block_tables, ctx_lens, kv_pool) if is_decode else {}
        )
        meta = AttentionMetadata(
            write_rows=self._per_layer(slot_rows, 2 * bs, bs).unbind(0),
            block_tables=block_tables,
            ctx_lens=ctx_lens,
            q_lens=q_lens,
            is_decode=is_decode,
            cos_sin=self.model.rotary.lookup(pos),
            **decode_fields,
        )
        last = torch.tensor(q_lens, device=dev).cumsum(0) - 1  # each chunk's last token
        return meta, last

    def _decode_fields(
        self, spans: list[tuple[Sequence, int, int]], block_tables: torch.Tensor,
        ctx_lens: list[int], kv_pool: torch.Tensor,
    ) -> dict[str, Any]:  # fmt: skip
        """Where decode attention reads: the kept dense K/V (CPU) or the pool's blocks."""
        dev = self.device
        base = block_tables.flatten() * (2 * self.model_config.num_layers)
        rows = self._per_layer(base, 2, 1).flatten(1)  # (L, 2 * B * W) (block, layer, K|V)
        fields: dict[str, Any] = {}
        if self._dense is not None:
            seqs: list[object] = [seq for seq, _, _ in spans]
            kv, dense_rows = self._dense.prepare(kv_pool, seqs, ctx_lens, rows)
            fields.update(dense_kv=kv, dense_rows=dense_rows)
            width = max(ctx_lens)
        else:
            fields["gather_rows"] = rows.unbind(0)
            width = block_tables.shape[1] * self.block_size
        slots = torch.arange(width, device=dev)
        ctx = torch.tensor(ctx_lens, device=dev)
        bias = torch.zeros(len(spans), 1, 1, width, dtype=self.kv_dtype, device=dev)
        bias.masked_fill_((slots.unsqueeze(0) >= ctx.unsqueeze(1))[:, None, None, :], float("-inf"))
        fields["attn_bias"] = bias  # (B, 1, 1, S)
        return fields

    def _per_layer(self, base: torch.Tensor, layer_stride: int, v_stride: int) -> torch.Tensor:
        """``base`` (N,) rows of layer 0's K -> (L, 2, N) rows of layer l's K, then V.

        A block's rows run (layer, K|V, slot): a layer is ``layer_stride`` rows further on,
        and V ``v_stride`` rows after K.
        """
        num_layers = self.model_config.num_layers
        layers = torch.arange(num_layers, device=self.device).view(-1, 1, 1) * layer_stride
        kv = torch.tensor([0, v_stride], device=self.device).view(1, 2, 1)
        return base.view(1, 1, -1) + layers + kv

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        """Pick each sequence's next token (output position ``len(seq.output_ids)``)."""
        rows = [SampleRequest(s.sampling, s.prompt_ids, s.output_ids) for s in seqs]
        out = sample(logits, rows, self.generator, batch_constraint(self.grammars, seqs))
        if out.token_ids.is_cuda:
            # Every caller reads the sample on the host (token lists, numpy batches):
            # one copy per step, not one sync per element.
            out = SampleOutput(out.token_ids.cpu(), out.logprobs.cpu(), out.top_ids.cpu(),
                               out.top_logprobs.cpu())  # fmt: skip
        return out

    def grammar_ready(self, seq: Sequence) -> bool:
        """May ``seq`` be sampled: no grammar, or its grammar is compiled.

        Raises ``GrammarError`` if its grammar failed to compile.
        """
        spec = seq.sampling.grammar
        return spec is None or seq.grammar is not None or self.grammars.ready(spec)

    def check_stop(self, seq: Sequence) -> Finish:
        """Why ``seq`` must stop after its newest token, or ``Finish.NONE``."""
        assert seq.output_ids, "check_stop runs after a token is appended"
        last = seq.output_ids[-1]
        params = seq.sampling
        if last in params.stop_token_ids:
            return Finish.STOP
        if not params.ignore_eos and last in self.eos_token_ids:
            return Finish.STOP
        if seq.grammar is not None and seq.grammar.terminated:
            return Finish.STOP
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return Finish.LENGTH
        return Finish.NONE


def _newest(seq: Sequence) -> int:
    return seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]


def _token_span(seq: Sequence, start: int, n: int) -> list[int]:
    """``seq.all_ids[start : start + n]`` without concatenating prompt and output."""
    p = len(seq.prompt_ids)
    if start + n <= p:
        return seq.prompt_ids[start : start + n]
    if start >= p:
        return seq.output_ids[start - p : start - p + n]
    return seq.prompt_ids[start:] + seq.output_ids[: start + n - p]
