"""The prefill worker: batched, chunked prefill, first-token sampling and KV export."""
