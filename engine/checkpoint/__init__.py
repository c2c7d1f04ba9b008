"""Checkpoint files -> a model's parameters.

    loader.py       safetensors (single or sharded) or GGUF -> CausalLM parameters
    gguf.py         GGUF weights, de-quantized or kept packed
    gguf_config.py  a GGUF file's metadata -> ModelConfig
    gguf_reader.py  the GGUF container: header, metadata, tensor index

(The top-level ``checkpoints`` package builds the test fixtures; this room reads them.)
"""
