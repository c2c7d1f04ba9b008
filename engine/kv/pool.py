"""An engine's KV pool: the pool tensor, its block allocator, and what schedulers do with
blocks: grow a sequence's table, reuse a cached prefix (from the pool or the tiers beyond
it), fork, publish full blocks, pin blocks for a transfer, free.

Who calls what:
- ``reuse_prefix`` (prefix caching) points a fresh sequence at the pool's blocks of its
  longest cached prefix; call it before planning the sequence's first chunk;
- ``ensure_blocks`` grows a sequence's block table (``NoFreeBlocks`` leaves it as it was);
  the runner's ``prefill``/``decode`` call it too, so a caller that pre-allocated pays
  nothing;
- the runner publishes every block its forwards fill (``cache_full_blocks``); a caller
  that writes KV some other way (a decode worker importing a transfer) calls it itself;
- ``free_blocks`` returns a finished sequence's blocks (and tells the runner's caches).
Schedulers and workers go through these methods; ``allocator`` is for tests to inspect.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv.block_allocator import BlockAllocator, KVFigures
from engine.kv.kv_cache import GpuMemoryError, allocate_kv_pool, check_kv_pool, pool_layout
from engine.kv.sequence import Sequence
from engine.kv.tiers.open_tiers import open_tiers


class KVPool:
    """One engine's KV blocks. ``tensor``: ``(num_blocks, L, 2, block_size, KVH, D)``."""

    def __init__(self, tensor: torch.Tensor, config: EngineConfig, order: str = "tokens") -> None:
        self.tensor = tensor
        self.block_size = config.block_size
        self.prefix_caching = config.enable_prefix_caching
        self.allocator = BlockAllocator(int(tensor.shape[0]))
        # KV beyond the pool (host RAM, disk): offered every registered block, asked on a miss.
        self.tiers = open_tiers(config, tensor, order)
        # Whether the owner calls ``store_offered`` after each step (once its tokens are
        # sent), so a prompt's tier-2 stores are off its TTFT; else they run as offered.
        self.defer_tier_stores = False
        # Per-sequence state elsewhere (the runner's dense K/V, kernel caches) that must
        # forget a sequence whose blocks are freed.
        self._on_free: list[Callable[[Sequence], None]] = []

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        num_blocks: Callable[[], int],
        given: torch.Tensor | None = None,
        order: str = "tokens",
    ) -> KVPool:
        """A pool of ``num_blocks()`` blocks (asked only when no tensor is ``given``), or
        over ``given`` (checked: shape, dtype, device). ``GpuMemoryError`` when it does not
        fit on the device."""
        device = torch.device(config.device)
        if given is not None:
            check_kv_pool(given, model_config, config.block_size)
            if given.dtype != dtype or given.device.type != device.type:
                raise ValueError(f"kv_pool must be {dtype} on {device}")
            return cls(given, config, order)
        n = num_blocks()
        try:
            tensor = allocate_kv_pool(model_config, n, config.block_size, dtype, device)
        except torch.cuda.OutOfMemoryError as e:
            nbytes = pool_layout(model_config, n, config.block_size, dtype).nbytes
            raise GpuMemoryError(
                f"a KV cache of {n} blocks ({nbytes / (1 << 30):.2f} GiB) does not fit on "
                f"{device}: another process may hold its memory; lower "
                "--gpu-memory-utilization (or --kv-cache-tokens with --kv-transfer shm)"
            ) from e
        return cls(tensor, config, order)

    def on_free(self, forget: Callable[[Sequence], None]) -> None:
        """Call ``forget(seq)`` whenever ``seq``'s blocks are freed."""
        self._on_free.append(forget)

    # ---- a sequence's blocks -------------------------------------------------------------

    def ensure_blocks(self, seq: Sequence, n: int) -> None:
        """Grow ``seq.block_table`` to hold ``n`` more computed tokens (all or nothing)."""
        assert seq.block_size == self.block_size, "sequence built for another block size"
        need = seq.blocks_needed(n)
        if need:
            self._release_stored()
            seq.block_table.extend(self.allocator.allocate(need))

    def _release_stored(self) -> None:
        """Drop the references held on blocks whose tier-2 store copies have finished
        (a CUDA pool's stores read their blocks off the step: ``cache_full_blocks``)."""
        if self.tiers is not None:
            done = self.tiers.take_released()
            if done:
                self.allocator.free(done)

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
            if not self.prefix_caching or seq.block_table or seq.num_computed_tokens:
                return 0
            self._release_stored()
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
        assert self.tiers is not None
        first = len(seq.block_table)
        for i, b in enumerate(blocks):
            # A block another sequence registered meanwhile keeps the pool's copy; this
            # one stays private (register's rule), both hold the same KV.
            self.allocator.register(b, hashes[first + i])
        seq.block_table += blocks
        # Tier-3 blocks go on to tier 2 off the step, each held until its copy is done.
        held = self.tiers.promote()
        if held:
            self.allocator.share(held)

    def tier_loading(self, seq: Sequence) -> bool:
        """Is ``seq`` parked while its blocks are read from tier 3?"""
        return seq.tier_load is not None

    def tier_load_pending(self, seq: Sequence) -> bool:
        """Is ``seq`` parked on tier reads that have not finished yet?"""
        return seq.tier_load is not None and not seq.tier_load.done()

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
            self._release_stored()
            tail = self.allocator.allocate(1)
            self.tensor[tail[0]].copy_(self.tensor[blocks[-1]])
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
        if not self.prefix_caching:
            return
        first, end = start // self.block_size, seq.num_computed_tokens // self.block_size
        if first >= end:
            return
        hashes = seq.full_block_hashes(end)
        for i in range(first, end):
            self.allocator.register(seq.block_table[i], hashes[i])
        if self.tiers is not None:
            # A copy still reading a block holds a reference on it until it is done, so
            # no eviction hands the block out to be overwritten meanwhile.
            held = self.tiers.offer(seq, first, end)
            if held:
                self.allocator.share(held)
            if not self.defer_tier_stores:
                self.store_offered()

    def store_offered(self) -> None:
        """Run the tier-2 stores of the blocks published since the last call (see
        ``defer_tier_stores``); their pool blocks are held until then, never rewritten."""
        if self.tiers is not None:
            self.tiers.store_offered()

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Return ``seq``'s blocks past its first ``keep`` (they hold nothing it keeps)."""
        if len(seq.block_table) > keep:
            self.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free_blocks(self, seq: Sequence) -> None:
        """Return a sequence's blocks to the pool; its KV is gone (num_computed_tokens = 0)."""
        for forget in self._on_free:
            forget(seq)
        if seq.tier_load is not None:  # aborted or preempted while parked
            seq.tier_load.cancel()
            seq.tier_load = None
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.prefix_queried = False  # recomputing it, if ever, starts with a new lookup

    def writable(self, block_id: int) -> bool:
        return self.allocator.writable(block_id)

    # ---- the pool as a whole -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole pool: a sequence needing more can never run here."""
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``ensure_blocks`` can have now: free ones plus evictable cached ones."""
        self._release_stored()
        return self.allocator.num_available

    def acquire_cached(self, hashes: list[int]) -> list[int]:
        """The pool's blocks of the longest prefix of ``hashes``, one reference each taken
        (a decode worker's lookup for handed-off KV; ``reuse_prefix`` is the usual way)."""
        return self.allocator.acquire(hashes)

    def count_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Record a lookup made outside ``reuse_prefix`` in the prefix-cache counters."""
        self.allocator.stats.queried_tokens += queried_tokens
        self.allocator.stats.hit_tokens += hit_tokens

    def pin(self, ids: list[int]) -> None:
        """Hand a sequence's references on ``ids`` to an outgoing transfer (prefill)."""
        self.allocator.pin(ids)

    def unpin(self, ids: list[int]) -> None:
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

    def figures(self) -> KVFigures:
        self._release_stored()
        return self.allocator.figures()
