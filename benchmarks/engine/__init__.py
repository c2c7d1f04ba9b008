"""The engine and its parts in one process: steps against their bare math and against
transformers, kernels against each other, perplexity per weight storage, grammar compile
times, speculation's rounding, the detokenizer's throughput."""
