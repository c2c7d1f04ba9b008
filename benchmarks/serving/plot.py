"""PNG plots: latency CDFs of one run, throughput-latency curves of a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt
import numpy as np


def plot_run(result: dict[str, Any], path: Path) -> None:
    """TTFT and ITL cumulative distributions (ms) of one run."""
    ttfts = [t * 1000 for t, e in zip(result["ttfts"], result["errors"]) if not e]
    itls = [g * 1000 for gaps in result["itls"] for g in gaps]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, name in ((axes[0], ttfts, "TTFT"), (axes[1], itls, "ITL")):
        xs = np.sort(np.asarray(values))
        ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1))
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", title=f"{name} CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(results: list[dict[str, Any]], path: Path, x_label: str) -> None:
    """Output throughput against p50/p99 TTFT and TPOT, one point per sweep value."""
    thr = [r["output_throughput"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for stat in ("median", "p99"):
            ax.plot(
                thr,
                [r[f"{stat}_{metric}_ms"] for r in results],
                marker="o",
                label=f"{'p50' if stat == 'median' else stat}",
            )
        for r, x in zip(results, thr):
            ax.annotate(str(r.get(x_label, "")), (x, r[f"p99_{metric}_ms"]), fontsize=7)
        ax.set(
            xlabel="output throughput (tok/s)",
            ylabel=f"{metric.upper()} (ms)",
            title=f"{metric.upper()} vs throughput ({x_label})",
        )
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
