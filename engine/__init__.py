"""The model engine both worker pools share: model code, paged KV cache, sampling."""
