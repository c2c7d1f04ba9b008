"""The model engine both worker pools share: model code, paged KV cache, sampling.

Rooms, bottom up (``tools/check_layers.py`` keeps imports pointing down this list):
    errors.py, config.py  typed engine errors; ModelConfig, EngineConfig (CLI defaults)
    weights/     how weights are stored: dense or group-quantized linears, chosen at load
    tokenizer/   the Hugging Face tokenizer and the one a GGUF file carries
    sampling/    penalties, temperature, top-k/p, seeded draws; grammar-constrained masks
    model/       the decoder (Llama / Mistral / Qwen2 / Qwen3), its layers, rope, attention
    kv/          the paged KV pool, its block allocator, block-table rows, Sequence
    checkpoint/  safetensors and GGUF files -> a model's parameters (not the top-level
                 ``checkpoints`` package, which builds test fixtures)
    cuda/        the CUDA path: Triton kernels, their choice, graph capture, KV sizing
    runner.py    ModelRunner: prefill / decode / sample / check_stop, and the small KV
                 interface the schedulers use (what workers call)

Model code knows tokens, positions and block tables, never requests; which linear kind or
attention backend runs is chosen at load, not branched on in the model.
(The in-process ``LLM`` and the co-located loop live in colocated/.)
"""
