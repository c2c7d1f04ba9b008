"""Checkpoint files -> a model's parameters.

    loader.py       safetensors (single or sharded) or GGUF -> CausalLM parameters
    gguf.py         GGUF weights, de-quantized or kept packed
    gguf_config.py  a GGUF file's metadata -> ModelConfig
    image.py        a loaded model's weights as named tensors, and a model built over them
    shared_weights.py  one copy of those per host, in a memfd every CPU worker maps

(The GGUF container's header reader is ``engine/gguf_reader.py``, a bottom room: the
launcher's quantization choice reads it too. The top-level ``checkpoints`` package builds
the test fixtures; this room reads them.)
"""
