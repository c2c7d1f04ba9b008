"""The model definition: knows tokens, positions and block tables, never requests.

    causal_lm.py  Llama / Mistral / Qwen2 (qkv bias) / Qwen3 (q/k norm) decoder
    layers.py     RMSNorm, gated MLP
    rope.py       rotary tables, incl. linear and Llama 3 scaling
    attention.py  attention over the paged pool (torch: SDPA + grouped einsum)

Linear layers come from ``engine.weights.linear``; the kind is chosen at load.
"""
