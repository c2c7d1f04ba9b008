"""Builds the two C helpers: transport's ordered loads/stores for the shm rings, and the
frontend's accept thread (health probes answered off the event loop).

Everything else about the package lives in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("transport._atomics", ["transport/_atomics.c"], extra_compile_args=["-O2"]),
        Extension(
            "frontend.http._acceptor", ["frontend/http/_acceptor.c"], extra_compile_args=["-O2"]
        ),
    ]
)
