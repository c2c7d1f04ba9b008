"""KV memory and the sequences that own it.

    pool.py              KVPool: the pool tensor and its allocator, and what schedulers do
                         with blocks (reuse a prefix, fork, publish, pin, free)
    kv_cache.py          allocating and checking the block-major pool tensor
    block_allocator.py     BlockAllocator: free / cached / used / pinned, ref counts, prefix
                         hash table; block_hashes() (the frontend may call it too)
    block_table_rows.py  the persistent block-table rows a batch names by index
    sequence.py          Sequence: tokens, block table, num_computed/num_cached_tokens
    tiers/               KV beyond the pool: host RAM shared by a host's workers, local
                         disk; offered every registered block, asked on a prefix miss

Schedulers use ``KVPool`` (``Engine.kv``, engine/build.py) and never the allocator it holds.
"""
