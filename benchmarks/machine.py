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
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [head, f"os.cpu_count() = {os.cpu_count()}, load average {load}"]
    lines.append(f"python {platform.python_version()}, {_torch()}")
    return "\n".join(lines)


def _torch() -> str:
    try:
        import torch
    except ImportError:
        return "no torch"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, {gpu}"
