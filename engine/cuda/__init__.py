"""The CUDA path, taken only when a GPU and Triton are there.

kernels/        Triton paged decode/extend attention and fused ops
kernel_path.py  chooses the kernels and runs a step through them
graphs.py       captures decode steps in CUDA graphs (padded batch buckets)
gpu_memory.py   how many KV blocks fit on a GPU after a profiling forward
"""
