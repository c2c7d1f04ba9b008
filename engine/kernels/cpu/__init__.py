"""pdserve's CPU kernels: C++ by family (``common.h`` lists the files), built by ``setup.py``
into one library, ``_kernels*.so``, registered as ``torch.ops.pdserve``; ``ops`` loads it."""
