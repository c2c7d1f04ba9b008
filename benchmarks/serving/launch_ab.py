"""Two ``launch`` settings served side by side, one streamed request at a time, alternating.

    python -m benchmarks.serving.launch_ab --a "--colocated 1 --share-weights" --b "--colocated 1" \
        [--a-tree DIR] [--b-tree DIR] [--requests 16] [--prompt-words 250] [--tokens 64] \
        [--out FILE]

``--a-tree``/``--b-tree``: serve that side from another checkout (a worktree of another
commit, its extension built in place), to compare two versions of the code.

Both servers run the default model at once (idle between requests: nothing spins), and
each request goes to one, then the other, their order swapped every round, so load on a
shared machine hits both alike. Per server: TTFT p50 (send to first token) and TPOT p50
(the mean gap between a stream's later tokens), greedy, ``ignore_eos``, and each engine
worker's PSS at the end (``/proc/PID/smaps_rollup``). Writes a markdown page to ``--out``
(default: printed only).
"""

from __future__ import annotations

import argparse
import random
import shlex
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.machine import load_average
from benchmarks.harness.servers import launch
from benchmarks.harness.sse import sse_chunks
from benchmarks.harness.words import PLAIN_WORDS
from bundled_models.default_model import DEFAULT_MODEL_NAME, default_model_dir


def _request(client: httpx.Client, url: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed completion."""
    body = {
        "model": DEFAULT_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for _ in sse_chunks(r.iter_lines()):
            stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{url}: {len(stamps)} chunks streamed")
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _engine_pss(pid: int) -> dict[str, float]:
    """MiB of PSS of each engine worker under the launcher ``pid``."""
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        name = Path(f"/proc/{child}/cmdline").read_text().split("\0")[0]
        if not name.startswith("pdserve:") or name.split(":")[1].split("-")[0] not in (
            "prefill",
            "decode",
            "colocated",
        ):
            continue
        for line in Path(f"/proc/{child}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "Pss":
                out[name] = int(rest.split()[0]) / 1024
    return out


def _commit(tree: Path | None) -> str:
    """The short commit ``tree`` (default: this checkout) has checked out."""
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def _tree_flags(a: Path | None, b: Path | None) -> str:
    """The tree flags as given, for the recorded command (``DIR``: a path of this machine)."""
    return "".join(f" --{n}-tree DIR" for n, t in (("a", a), ("b", b)) if t is not None)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The two servers compared: each one's launch flags and the checkout it serves from."""
    p.add_argument("--a", required=True, help="launch flags of server A")
    p.add_argument("--b", required=True, help="launch flags of server B")
    p.add_argument("--a-tree", type=Path, default=None, help="checkout serving A (default: this)")
    p.add_argument("--b-tree", type=Path, default=None, help="checkout serving B (default: this)")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.launch_ab", description=__doc__)
    add_server_flags(p)
    p.add_argument("--requests", type=int, default=16, help="per server")
    p.add_argument("--prompt-words", type=int, default=250)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = str(default_model_dir())
    start_load = load_average()
    servers = {}
    try:
        for name, flags, tree in (("A", args.a, args.a_tree), ("B", args.b, args.b_tree)):
            servers[name] = launch(["--model", model, *shlex.split(flags)], tree)
        rng = random.Random(0)
        got: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
        with httpx.Client(timeout=120) as client:
            for i in range(args.requests + 1):  # the first round warms both up
                prompt = " ".join(rng.choice(PLAIN_WORDS) for _ in range(args.prompt_words))
                for name in ("A", "B") if i % 2 else ("B", "A"):
                    result = _request(client, servers[name][1], prompt, args.tokens)
                    if i:
                        got[name].append(result)
        pss = {name: _engine_pss(proc.pid) for name, (proc, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in servers.values():
            proc.wait(timeout=60)
    lines = [
        "| server | launch flags | TTFT p50 ms | TPOT p50 ms | engine workers' PSS MiB |",
        "|---|---|---:|---:|---|",
    ]
    ttft = {name: statistics.median(t for t, _ in runs) for name, runs in got.items()}
    tpot = {name: statistics.median(t for _, t in runs) for name, runs in got.items()}
    for name, flags, tree in (("A", args.a, args.a_tree), ("B", args.b, args.b_tree)):
        mem = ", ".join(f"{k} {v:.0f}" for k, v in sorted(pss[name].items()))
        lines.append(
            f"| {name} | `{flags}` at {_commit(tree)} | {ttft[name] * 1e3:.1f} "
            f"| {tpot[name] * 1e3:.2f} | {mem} |"
        )
    lines += [
        "",
        f"TTFT p50 B / A: {ttft['B'] / ttft['A']:.3f}; "
        f"TPOT p50 B / A: {tpot['B'] / tpot['A']:.3f}.",
    ]
    write_page(
        "Two launch settings, alternating requests",
        f"Command: `python -m benchmarks.serving.launch_ab --a {shlex.quote(args.a)} "
        f"--b {shlex.quote(args.b)}{_tree_flags(args.a_tree, args.b_tree)} "
        f"--requests {args.requests}`; default model, "
        f"{args.prompt_words}-word prompts, {args.tokens} tokens, greedy. Load average at "
        f"the start: {start_load}; at the end: {load_average()}.",
        lines,
        args.out,
    )


def write_page(title: str, command: str, lines: list[str], out: Path | None) -> None:
    """Print ``lines`` (the tables); with ``out``, write them there as a page under
    ``title`` and ``command``, with the machine's description."""
    page = [f"# {title}", "", command, "", *lines, "", "Machine:", "", "```", describe_machine()]
    print("\n".join(lines))
    if out is not None:
        out.write_text("\n".join([*page, "```", ""]))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
