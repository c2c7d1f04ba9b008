"""Builds transport's one C helper (ordered loads/stores for the shm rings).

Everything else about the package lives in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("transport._atomics", ["transport/_atomics.c"], extra_compile_args=["-O2"])
    ]
)
