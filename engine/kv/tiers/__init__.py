"""KV beyond the pool: tier 2 (host RAM shared by a host's workers), tier 3 (local disk).

    keys.py        the namespace digest and the 128-bit chained block keys both tiers use
    host_store.py  HostStore: a node-wide block store in shared memory (tier 2)
    disk_store.py  DiskStore: one verified file per block in a directory (tier 3)
    persister.py   the one writer of tier 3, fed from tier 2 (write-behind, flush on stop)
    tiered.py      TieredKV: what the runner calls to offer full blocks and load prefixes

The pool stays tier 1 and knows nothing of the others: ``engine.runner.ModelRunner``
offers every block it registers and, on a prefix miss, asks for the longest run of
consecutive blocks the tiers hold, which it copies into fresh pool blocks.
"""
