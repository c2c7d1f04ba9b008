"""``python -m benchmarks.serving``: load-test any OpenAI-compatible server.

Works against pdserve, vLLM, SGLang or llama.cpp's server: it speaks only streamed
``/v1/completions`` or ``/v1/chat/completions``. See ``__main__`` for the options and
``metrics`` for how each figure is defined.
"""
