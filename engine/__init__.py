"""The model engine both worker pools share: model code, paged KV cache, sampling.

Model code (knows tokens, positions and block tables, never requests):
    config.py     ModelConfig (from a HF checkpoint dir), EngineConfig (CLI defaults)
    loader.py     safetensors (single or sharded) -> CausalLM parameters
    model.py      Llama / Mistral / Qwen2 (qkv bias) / Qwen3 (q/k norm) decoder
    layers.py     RMSNorm, gated MLP
    rope.py       rotary tables, incl. linear and Llama 3 scaling
    attention.py  attention over the paged pool (torch: SDPA + grouped einsum)
    kernels/      Triton paged decode/extend attention and fused ops (the CUDA path);
                  kernel_path.py chooses them, cuda_graphs.py captures decode steps
Checkpoints:
    gguf*.py         GGUF files: reader, config, de-quantized weights, tokenizer
    hf_tokenizer.py  the Hugging Face tokenizer, without torch where that is exact
KV memory and requests:
    kv_cache.py       the block-major pool tensor and its byte size per block
    gpu_memory.py     how many KV blocks fit on a GPU after a profiling forward
    block_manager.py  BlockAllocator: free / cached / used / pinned, ref counts, prefix
                      hash table; block_hashes() (the frontend may call it too)
    sequence.py       Sequence: tokens, block table, num_computed/num_cached_tokens
Running:
    runner.py   ModelRunner: prefill / decode / sample / check_stop (what workers call)
    sampler.py  penalties, temperature, top-k/p, min-p, seeded draws, logprobs
Structured output:
    grammar.py        GrammarCache (compile on a thread, cache by spec), GrammarState
                      (a sequence's matcher); torch comes only with xgrammar, on first use
    grammar_mask.py   the token bitmask per step (fill, apply to the logits)
    grammar_vocab.py  the vocabulary as xgrammar sees it, cached on disk per model
(The in-process ``LLM`` and the co-located loop live in colocated/.)
"""
