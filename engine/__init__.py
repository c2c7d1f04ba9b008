"""The model engine both worker pools share: model code, paged KV cache, sampling.

Rooms, bottom up (``tools/check_layers.py`` keeps imports pointing down this list):
    errors.py, config.py  typed engine errors; ModelConfig, EngineConfig (CLI defaults)
    kernels/     the CPU kernels: pdserve's own (C++, cpu/) and vLLM's compiled CPU ops
    gguf_reader.py  a GGUF file's header: metadata and tensor index, data left mapped
    weights/     how weights are stored: dense or group-quantized linears, chosen at load
    tokenizer/   the Hugging Face tokenizer and the one a GGUF file carries
    sampling/    penalties, temperature, top-k/p, seeded draws; grammar-constrained masks
    model/       the decoder (Llama / Mistral / Qwen2 / Qwen3), its layers, rope, attention
    kv/          KVPool (the pool tensor, its block allocator, prefix reuse, forks, pins;
                 what schedulers use), block-table rows, Sequence, the tiers beyond
    checkpoint/  safetensors and GGUF files -> a model's parameters (not the top-level
                 ``checkpoints`` package, which builds test fixtures)
    cuda/        the CUDA path: Triton kernels, their choice, graph capture, KV sizing
    runner.py    ModelRunner: prefill / decode / verify forwards over the pool, sampling
    build.py     build_engine: loads the weights, adapters and grammars, picks the attention
                 backend, sizes the KVPool; hands the schedulers an Engine (runner, kv,
                 grammars, loras, stops)

Model code knows tokens, positions and block tables, never requests; which linear kind or
attention backend runs is chosen at load, not branched on in the model.
(The in-process ``LLM`` and the co-located loop live in colocated/.)
"""
