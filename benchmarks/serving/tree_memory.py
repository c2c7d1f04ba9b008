"""The process tree's memory after traffic: PSS per process, and what the weights cost.

    python -m benchmarks.serving.tree_memory [--requests 48] [--concurrency 24] [--out FILE] \
        -- --prefill 2 --decode 2 --detokenizers 2

Everything after ``--`` goes to ``launch`` as is (no ``--model``: the embedded default, the
packed SmolLM2 GGUF). Once every worker is ready it sends ``--requests`` greedy chat
requests of about 256 prompt and 64 output tokens, ``--concurrency`` at a time (enough
rows that decode workers run their many-rows GEMM too), waits for the KV to drain, then
reads each process's ``/proc/PID/smaps_rollup`` and ``smaps``.

PSS (proportional set size) charges a page shared by n processes 1/n to each, so the
tree's PSS counts a shared page once, where summed RSS counts it once per process.
The shared weights segment is reported apart: its mapping's size, the pages resident,
and the PSS the tree holds of it. Pages of a segment no process maps are in no one's
PSS, so the page also gives the host's ``Shmem`` growth over the idle machine.

Afterwards the tree is SIGKILLed whole (every process of its session at once) and
``/dev/shm`` is listed: what a killed server leaves behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.machine import machine_block, portable
from benchmarks.harness.processes import process_tree
from benchmarks.harness.servers import free_port, session_members
from benchmarks.harness.words import PLAIN_WORDS

# The name a shared weights segment shows in /proc/PID/maps (engine/checkpoint/shared_weights.py).
WEIGHTS_MAPPING = "pdserve-weights"
MIB = 1 << 20


@dataclass
class ProcMemory:
    pid: int
    title: str
    rss: int
    pss: int
    pss_anon: int
    pss_shmem: int
    weights_size: int = 0  # bytes of the weights mapping (0: not mapped)
    weights_rss: int = 0
    weights_pss: int = 0


@dataclass
class Result:
    procs: list[ProcMemory] = field(default_factory=list)
    shmem_growth: int = 0  # host Shmem now minus before launch
    left_in_dev_shm: list[str] = field(default_factory=list)
    answer: str = ""


def smaps_rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup``'s fields in bytes (``Pss``, ``Rss``, ``Pss_Anon`` ...)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name] = int(parts[0]) * 1024
    return out


def mapping_usage(pid: int, needle: str) -> tuple[int, int, int]:
    """(size, rss, pss) in bytes summed over ``pid``'s mappings whose name holds ``needle``."""
    size = rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            inside = len(head) == 6 and needle in head[5]
            continue
        if not inside:
            continue
        name, _, rest = line.partition(":")
        if name in ("Size", "Rss", "Pss"):
            kb = int(rest.split()[0]) * 1024
            size += kb if name == "Size" else 0
            rss += kb if name == "Rss" else 0
            pss += kb if name == "Pss" else 0
    return size, rss, pss


def shmem_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def _title(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    words = raw.replace(b"\0", b" ").decode(errors="replace").split()
    return words[0] if words and words[0].startswith("pdserve:") else "launcher"


def measure(root: int) -> list[ProcMemory]:
    procs = []
    for pid in process_tree(root):
        try:
            roll = smaps_rollup(pid)
            weights = mapping_usage(pid, WEIGHTS_MAPPING)
        except OSError:
            continue  # exited meanwhile
        procs.append(
            ProcMemory(
                pid,
                _title(pid),
                roll.get("Rss", 0),
                roll.get("Pss", 0),
                roll.get("Pss_Anon", 0),
                roll.get("Pss_Shmem", 0),
                *weights,
            )
        )
    return sorted(procs, key=lambda p: p.title)


def _traffic(url: str, requests: int, concurrency: int) -> str:
    """``requests`` greedy chats of ~256 prompt tokens, ``concurrency`` at once; returns the
    answer to one plain question asked last."""
    with httpx.Client(base_url=url, timeout=300) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]

        def one(i: int) -> None:
            words = " ".join(PLAIN_WORDS[(i + j) % len(PLAIN_WORDS)] for j in range(200))
            body = {
                "model": model,
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{i}: repeat after me: {words}"}],
            }
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
        body = {
            "model": model,
            "max_tokens": 20,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
        return str(c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"])


def _wait_ready(proc: subprocess.Popen[str], url: str, log: list[str]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("launch exited before serving:\n" + "".join(log[-30:]))
        try:
            if httpx.get(url + "/health", timeout=5).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError("not every worker ready after 600 s:\n" + "".join(log[-30:]))


def one_run(
    launch_args: list[str], requests: int, concurrency: int, code: Path | None = None
) -> Result:
    """One launch, traffic, measurement and SIGKILL. ``code``: a checkout to launch instead
    of this one (its own C extensions built), to measure another version the same way."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    before = set(os.listdir("/dev/shm"))
    shmem0 = shmem_bytes()
    port = free_port()
    cmd = [sys.executable, "-m", "launcher.cli", "--port", str(port), *launch_args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
        cwd=code,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout or ()), daemon=True).start()
    res = Result()
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, log)
        res.answer = _traffic(url, requests, concurrency)
        time.sleep(2.0)  # the last KV frees and the idle steps settle
        res.procs = measure(proc.pid)
        res.shmem_growth = shmem_bytes() - shmem0
    finally:
        # SIGKILL the whole session at once: no process gets to clean up after itself.
        for pid in session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    res.left_in_dev_shm = sorted(set(os.listdir("/dev/shm")) - before)
    return res


def report(res: Result, command: str) -> list[str]:
    def mib(x: int) -> str:
        return f"{x / MIB:.1f}"

    lines = [
        "| process | RSS MiB | PSS MiB | PSS anon MiB | PSS shmem MiB | weights mapping MiB "
        "(resident / PSS) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in res.procs:
        weights = (
            f"{mib(p.weights_size)} ({mib(p.weights_rss)} / {mib(p.weights_pss)})"
            if p.weights_size
            else "-"
        )
        lines.append(
            f"| {p.title} | {mib(p.rss)} | {mib(p.pss)} | {mib(p.pss_anon)} | "
            f"{mib(p.pss_shmem)} | {weights} |"
        )
    pss = sum(p.pss for p in res.procs)
    rss = sum(p.rss for p in res.procs)
    wpss = sum(p.weights_pss for p in res.procs)
    lines += [
        f"| **tree** | {mib(rss)} | **{mib(pss)}** | {mib(sum(p.pss_anon for p in res.procs))} "
        f"| {mib(sum(p.pss_shmem for p in res.procs))} | PSS {mib(wpss)} |",
        "",
        f"Command: `{command}`. Tree PSS **{pss / (1 << 30):.2f} GiB** (summed RSS "
        f"{rss / (1 << 30):.2f} GiB); host Shmem grew by {mib(res.shmem_growth)} MiB while "
        f"serving; left in /dev/shm after SIGKILL of the whole tree: "
        f"{res.left_in_dev_shm or 'nothing'}. Answer: {res.answer!r}",
        "",
    ]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--out", type=Path, default=None, help="append the section to this file")
    p.add_argument("--label", default="", help="a heading for this run's section")
    p.add_argument("--code", type=Path, default=None, help="launch this checkout's code")
    p.add_argument("launch_args", nargs="*")
    a = p.parse_args()
    from bundled_models.default_model import resolve_model

    given = (
        a.launch_args[a.launch_args.index("--model") + 1] if "--model" in a.launch_args else None
    )
    resolve_model(Path(given) if given else None)  # convert once, outside the run
    res = one_run(a.launch_args, a.requests, a.concurrency, a.code)
    cmd = portable(
        f"python -m benchmarks.serving.tree_memory --requests {a.requests} "
        f"--concurrency {a.concurrency} -- {' '.join(a.launch_args)}"
    )
    lines = [f"## {a.label}" if a.label else "## run", "", *report(res, cmd), *machine_block()]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with a.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
