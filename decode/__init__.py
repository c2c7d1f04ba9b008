"""The decode worker: KV import, continuous batching, sampling and engine stop checks."""
