"""A goodput run's results: per point summaries, the markdown page, the JSON and the plot."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.goodput.drive import Sent
from benchmarks.goodput.slo import (
    TARGET,
    Goodput,
    Outcome,
    Slo,
    attainment,
    goodput,
    percentiles_ms,
)
from benchmarks.goodput.traces import Arrival


@dataclass(frozen=True)
class Point:
    """One configuration on one trace at one rate; ``sent`` empty and ``skipped`` set
    when a lower rate already missed badly enough that this one was not sent."""

    config: str
    trace: str
    rate: float
    sent: tuple[Sent, ...] = ()
    seconds: float = 0.0
    skipped: str = ""
    roles: str = ""  # --workers: what its planner had done by the point's end (drive.roles_seen)

    def attainment(self, slo: Slo) -> float:
        return attainment([s.outcome for s in self.sent], slo)

    def summary(self, slo: Slo) -> dict[str, Any]:
        ok = [s.outcome for s in self.sent if s.outcome.ok]
        ttft = percentiles_ms([o.ttft for o in ok])
        tpot = percentiles_ms([o.tpot for o in ok if o.tpot is not None])
        short = sum(
            1
            for s in self.sent
            if s.outcome.ok and not s.outcome.cut and s.output_tokens < s.arrival.output_len
        )
        return {
            "requests": len(self.sent),
            "failed": sum(1 for s in self.sent if not s.outcome.ok),
            "cut": sum(1 for s in self.sent if s.outcome.cut),
            "short_outputs": short,
            "attainment": self.attainment(slo),
            "ttft_p50_ms": ttft[0],
            "ttft_p90_ms": ttft[1],
            "tpot_p50_ms": tpot[0],
            "tpot_p90_ms": tpot[1],
        }


@dataclass
class Run:
    """Everything one ``python -m benchmarks.goodput`` records."""

    command: str
    slo: Slo
    traces: list[str]
    configs: list[str]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    load_before: str = ""
    load_after: str = ""
    trace_slos: dict[str, Slo] = field(default_factory=dict)  # a trace's own targets
    machine: str = ""  # benchmarks.harness.machine.describe() when the run ended
    # 1-minute load average when each configuration's server started and when it stopped
    loads: dict[str, tuple[float, float]] = field(default_factory=dict)

    def slo_for(self, trace: str) -> Slo:
        return self.trace_slos.get(trace, self.slo)

    def sweep(self, config: str, trace: str) -> list[Point]:
        return sorted(
            (p for p in self.points if p.config == config and p.trace == trace),
            key=lambda p: p.rate,
        )

    def goodput(self, config: str, trace: str) -> Goodput | None:
        pts = self.sweep(config, trace)
        slo = self.slo_for(trace)
        measured = [(p.rate, p.attainment(slo)) for p in pts if not p.skipped]
        return goodput(measured) if measured else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _goodput_table(run: Run) -> list[str]:
    lines = [
        "| configuration | "
        + " | ".join(f"{t} goodput (req/s)" for t in run.traces)
        + " | load average (1 min) at start / end |",
        "|---|" + "---:|" * (len(run.traces) + 1),
    ]
    for config in run.configs:
        cells = []
        for trace in run.traces:
            g = run.goodput(config, trace)
            cells.append("-" if g is None else g.text())
        load = run.loads.get(config)
        cells.append("-" if load is None else f"{load[0]:.1f} / {load[1]:.1f}")
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    return lines


def _sweep_table(run: Run, trace: str) -> list[str]:
    lines = [
        "| configuration | rate (req/s) | requests | failed | cut | attainment "
        "| TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in run.configs:
        for p in run.sweep(config, trace):
            if p.skipped:
                lines.append(f"| `{config}` | {p.rate:g} | - | - | - | not sent: {p.skipped} | | |")
                continue
            s = p.summary(run.slo_for(trace))
            lines.append(
                f"| `{config}` | {p.rate:g} | {s['requests']} | {s['failed']} | {s['cut']} "
                f"| {100 * s['attainment']:.0f} % "
                f"| {_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p90_ms'])} "
                f"| {_ms(s['tpot_p50_ms'])} / {_ms(s['tpot_p90_ms'])} |"
            )
    planned = [p for c in run.configs for p in run.sweep(c, trace) if p.roles]
    if planned:
        lines += ["", "After each point (since the server started):", ""]
        lines += [f"- `{p.config}` at {p.rate:g} req/s: {p.roles}" for p in planned]
    return lines


def _overrides(run: Run) -> str:
    return "".join(
        f" ({t}: TTFT <= {s.ttft_ms:g} ms, TPOT <= {s.tpot_ms:g} ms)"
        for t, s in run.trace_slos.items()
    )


def render(run: Run, plot_name: str | None, machine: list[str]) -> str:
    """The markdown page; ``machine`` is the machine block (benchmarks.harness.machine)."""
    slo = run.slo
    lines = [
        "# Goodput: SLO attainment against request rate",
        "",
        f"Command: `{run.command}`",
        "",
        f"SLOs: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms{_overrides(run)}, "
        "both per request "
        f"(TPOT = mean time per output token after the first). Attainment = the fraction of "
        f"a point's requests that finished and met both; goodput = the rate at which "
        f"attainment falls to {100 * TARGET:.0f} %, interpolated linearly between the last "
        "swept rate that met it and the first that did not, as DistServe does "
        "(`< r`: even the lowest rate missed; `>= r`: every swept rate met it).",
        "",
        f"Load average (1, 5, 15 min): {run.load_before} at the start, "
        f"{run.load_after} at the end.",
        "",
        *(f"- {k}: {v}" for k, v in run.settings.items()),
        *(f"- {note}" for note in run.notes),
        "",
        "## Goodput",
        "",
        *_goodput_table(run),
        "",
    ]
    if plot_name:
        lines += [f"![SLO attainment against rate]({plot_name})", ""]
    for trace in run.traces:
        lines += [f"## Trace `{trace}`", "", *_sweep_table(run, trace), ""]
    return "\n".join(lines + machine)


def write_json(run: Run, path: Path) -> None:
    """Every request of every point, for re-analysis at other SLOs."""
    doc = asdict(run)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def read_json(path: Path) -> Run:
    """A run as ``write_json`` wrote it (to judge its requests against other SLOs)."""
    doc = json.loads(path.read_text())
    points = []
    for p in doc.pop("points"):
        sent = tuple(
            Sent(
                Arrival(**s["arrival"]),
                Outcome(**s["outcome"]),
                s["output_tokens"],
                s["server_prompt_tokens"],
                s["error"],
            )
            for s in p.pop("sent")
        )
        points.append(Point(**p, sent=sent))
    doc["slo"] = Slo(**doc["slo"])
    doc["trace_slos"] = {t: Slo(**s) for t, s in doc.get("trace_slos", {}).items()}
    doc["loads"] = {c: (a, b) for c, (a, b) in doc.get("loads", {}).items()}
    return Run(**doc, points=points)


def merge_runs(runs: list[Run]) -> Run:
    """Several runs as one (the first's SLOs and settings): configurations and traces in
    the order first seen, a later run's point replacing an earlier one's of the same
    configuration, trace and rate; each run's command, notes and loads kept."""
    first = runs[0]
    merged = Run(
        " ; then ".join(r.command for r in runs),
        first.slo,
        list(dict.fromkeys(t for r in runs for t in r.traces)),
        list(dict.fromkeys(c for r in runs for c in r.configs)),
        dict(first.settings),
        trace_slos=dict(first.trace_slos),
        machine=runs[-1].machine,
        load_before=first.load_before,
        load_after=runs[-1].load_after,
    )
    points: dict[tuple[str, str, float], Point] = {}
    for i, r in enumerate(runs):
        merged.notes += [f"run {i + 1}: {n}" for n in r.notes]
        if i:
            merged.notes += [f"run {i + 1}: {k}: {v}" for k, v in r.settings.items()]
        for p in r.points:
            key = (p.config, p.trace, p.rate)
            if key in points:
                merged.notes.append(
                    f"`{p.config}` {p.trace} at {p.rate:g} req/s was measured again in run "
                    f"{i + 1}: that point replaces the earlier one here"
                )
            points[key] = p
        merged.loads.update(r.loads)
    merged.points = list(points.values())
    return merged


def plot(run: Run, path: Path) -> None:
    """Attainment (%) against rate, one panel a trace, one line a configuration, with the
    90 % target dashed (the figure DistServe draws)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(run.traces), figsize=(5 * len(run.traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], run.traces):
        for i, config in enumerate(run.configs):
            pts = [p for p in run.sweep(config, trace) if p.sent]
            if pts:
                ys = [100 * p.attainment(run.slo_for(trace)) for p in pts]
                # Lines often coincide (few requests a point): each its own marker, dash
                # and size, the first drawn largest, so every one stays visible.
                style = {
                    "marker": "osD^vP*X"[i % 8],
                    "linestyle": ("-", "--", "-.", ":")[i % 4],
                    "markersize": max(3, 11 - 1.5 * i),
                }
                ax.plot([p.rate for p in pts], ys, label=config, **style)
        ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1)
        slo = run.slo_for(trace)
        title = f"{trace}: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms"
        ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title=title)
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
