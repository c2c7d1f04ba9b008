"""Builds the C helpers: transport's ordered loads/stores for the shm rings, the frontend's
accept thread (health probes answered off the event loop), and, where torch is importable
(``make setup`` runs ``setup.py build_ext --inplace`` in the venv after installing), pdserve's
CPU kernels registered as ``torch.ops.pdserve`` (``engine/kernels/cpu/``: one library built
from every ``.cpp`` there, loaded by ``engine/kernels/cpu/ops.py``).

Everything else about the package lives in pyproject.toml.
"""

import platform
from pathlib import Path

from setuptools import Extension, setup

ext_modules = [
    Extension("transport._atomics", ["transport/_atomics.c"], extra_compile_args=["-O2"]),
    Extension("frontend.http._acceptor", ["frontend/http/_acceptor.c"], extra_compile_args=["-O2"]),
]
cmdclass = {}
try:  # pip's isolated build has no torch: the CPU kernels are built by the second step
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    pass
else:
    if platform.machine().lower() in ("x86_64", "amd64"):
        # The AVX-512 and AMX code carries its own target attributes, so the library loads
        # on any x86-64 CPU; engine/kernels/cpu/ops.py and engine/weights/int4_tiles.py
        # decide whether it runs.
        kernels = Path("engine/kernels/cpu")
        ext_modules.append(
            CppExtension(
                "engine.kernels.cpu._kernels",
                sorted(str(p) for p in kernels.glob("*.cpp")),
                depends=sorted(str(p) for p in kernels.glob("*.h")),
                # -Wno-maybe-uninitialized: GCC 12 flags its own intrinsics headers (_mm512_undefined).
                extra_compile_args=["-O3", "-fopenmp", "-Wno-maybe-uninitialized"],
                extra_link_args=["-fopenmp"],
            )
        )
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=False)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
