"""Launched servers under load. ``python -m benchmarks.serving`` load-tests any
OpenAI-compatible server (pdserve, vLLM, SGLang, llama.cpp's server): it speaks only
streamed ``/v1/completions`` or ``/v1/chat/completions``; see ``__main__`` for the options
and ``metrics`` for how each figure is defined. Beside it, one module per question asked
of a launched pdserve: two settings side by side (``load_ab``, ``launch_ab``), soak,
overload, start-up, the tree's memory, prefix caching, KV tiers, the
frontends, the API fuzz (speculation and LoRA against the peers are in ``peers``)."""
