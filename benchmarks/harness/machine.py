"""The machine line every benchmark result carries: CPU, cores, load, GPU, versions."""

from __future__ import annotations

import os
import platform
import subprocess


def describe(lscpu_lines: int = 20) -> str:
    """``lscpu``'s head plus what decides how far figures can be trusted.

    The load average matters: results here are often taken on cores shared with other
    jobs, and a reader must be able to tell.
    """
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        head = "\n".join(lscpu.splitlines()[:lscpu_lines])
    except (OSError, subprocess.CalledProcessError):
        head = platform.processor() or platform.machine()
    lines = [head, f"vector flags: {' '.join(vector_flags()) or 'none found'}"]
    lines.append(f"os.cpu_count() = {os.cpu_count()}, load average {load_average()}")
    lines.append(f"python {platform.python_version()}, {_torch()}")
    return "\n".join(lines)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def report_head(title: str, command: str) -> list[str]:
    """The first lines of a results page: its title, the command that made it (already
    ``portable``) and the machine, then a blank line."""
    return [f"# {title}", "", f"Command: `{command}`", "", *machine_block()]


def machine_block() -> list[str]:
    """The ``Machine:`` section every results page ends (or begins) with: the heading, the
    ``describe()`` text fenced as code, then a blank line."""
    return ["Machine:", "", "```", describe(), "```", ""]


# The flags that decide which CPU kernels are fast (bfloat16 and int8 dot products, AMX).
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def vector_flags() -> list[str]:
    """Which of ``VECTOR_FLAGS`` this CPU reports (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return []
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def portable(text: str) -> str:
    """``text`` with this checkout's root as ``.`` and the home directory as ``~``: results
    are committed, and name the paths they ran with relative to where a reader stands."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    return text.replace(root + "/", "./").replace(root, ".").replace(str(Path.home()), "~")


def _torch() -> str:
    try:
        import torch
    except ImportError:
        return "no torch"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, {gpu}"
