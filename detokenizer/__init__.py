"""The sharded detokenizer pool: exact incremental detokenization and stop strings."""
