"""KV memory and the sequences that own it.

    kv_cache.py          the block-major pool tensor and its byte size per block
    block_manager.py     BlockAllocator: free / cached / used / pinned, ref counts, prefix
                         hash table; block_hashes() (the frontend may call it too)
    block_table_rows.py  the persistent block-table rows a batch names by index
    sequence.py          Sequence: tokens, block table, num_computed/num_cached_tokens
    tiers/               KV beyond the pool: host RAM shared by a host's workers, local
                         disk; offered every registered block, asked on a prefix miss

Schedulers do not reach in here: they use ModelRunner's KV interface (engine/runner.py).
"""
