"""KV beyond the pool: tier 2 (host RAM shared by a host's workers), tier 3 (local disk).

    keys.py        the namespace digest and the 128-bit chained block keys both tiers use
    host_store.py  HostStore: a node-wide block store in shared memory (tier 2)
    disk_store.py  DiskStore: one verified file per block in a directory (tier 3)
    persister.py   the one writer of tier 3, fed from tier 2 (write-behind, flush on stop)
    tiered.py      TieredKV: what the runner calls to offer full blocks and load prefixes
    disk_load.py   DiskLoader: tier-3 reads on loader threads while the request is parked
    async_tiers.py AsyncTieredKV: the same, with every copy off the step (a CUDA pool)
    cuda_copy.py   CudaCopier: side-stream copies to and from page-locked tier 2
    open_tiers.py  open_tiers: the tiers a pool's config names, of the class its device needs

The pool stays tier 1 and knows nothing of the others: ``engine.kv.pool.KVPool``
offers every block it registers and, on a prefix miss, asks for the longest run of
consecutive blocks the tiers hold, which it copies into fresh pool blocks.
"""
