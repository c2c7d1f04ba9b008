"""NIXL READ throughput between two processes: across a veth (UCX over TCP) and on one host
(UCX's default transports, shared memory).

The question for multi-host serving: what does a KV handoff cost once prefill and decode
sit on different machines and NIXL (UCX) moves the blocks? Two processes stand in for the
two workers. The *source* (prefill's role) registers a buffer filled with a seeded
pattern; the *reader* (decode's role) registers its own, loads the source's agent metadata
and READs the whole buffer as ``--desc-kib`` descriptors (the shape of a block-wise KV
fetch), checks every byte, and repeats. The source learns of each finished READ by
NIXL's notification, as a prefill worker would before freeing the blocks.

Placements (``run_placement``): ``veth-tcp``: source in namespace ``a``, reader in
``b`` of a ``benchmarks.cluster.netns_pair.NetnsPair``, ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES``
set to each side's veth end, so UCX can use that interface only; ``same-host``: both
processes in namespace ``a``, UCX left to choose (shared memory / CMA on one host). Both
run inside the pair's namespaces, so no byte can leave the machine, and the veth's byte
counters are recorded to show where the data really went.

    python -m benchmarks.cluster.nixl_link --mib 64 --desc-kib 256 --repeats 5

writes benchmarks/results/nixl_link.md and .json (``--out`` to change). Needs root
(network namespaces) and the ``nixl_cu12`` package.

Metadata and results travel over the two children's stdin/stdout as length-prefixed
frames (``write_frame``/``read_frame``): no sockets of our own, nothing pickled. A child
moves its own fd 1 onto stderr before loading NIXL, so anything the native libraries
print cannot corrupt the frame stream.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from benchmarks.cluster.netns_pair import NetnsPair, Side, available
from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.machine import portable

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "nixl_link"
Transport = Literal["tcp", "default"]
WARMUP = 1  # untimed READs first: the first one also sets up UCX's endpoint


# --- framing: 4-byte big-endian length, then the payload ---------------------------------


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(len(payload).to_bytes(4, "big") + payload)
    stream.flush()


def read_frame(stream: IO[bytes]) -> bytes:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("peer closed its pipe")
    n = int.from_bytes(head, "big")
    body = stream.read(n)
    if len(body) < n:
        raise EOFError("peer closed its pipe mid-frame")
    return body


def write_json(stream: IO[bytes], obj: dict[str, Any]) -> None:
    write_frame(stream, json.dumps(obj).encode())


def read_json(stream: IO[bytes]) -> dict[str, Any]:
    obj = json.loads(read_frame(stream))
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {obj!r}")
    return obj


# --- the two worker processes -------------------------------------------------------------


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """The source's contents; the reader rebuilds it to check every byte it READ."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _agent(name: str) -> Any:
    from transport.nixl_agent import load_nixl

    nixl = load_nixl()
    return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))


def _source(
    inp: IO[bytes], out: IO[bytes], nbytes: int, seed: int, reads: int, deadline: float
) -> None:
    """Serve one buffer; report the READ notifications that arrive (``reads`` expected)."""
    agent = _agent("source")
    buf = pattern(nbytes, seed)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    write_json(out, {"agent": "source", "addr": buf.ctypes.data, "nbytes": nbytes})
    write_frame(out, agent.get_agent_metadata())
    notifs: list[str] = []
    while len(notifs) < reads and time.monotonic() < deadline:
        for msgs in agent.get_new_notifs().values():
            notifs += [m.decode() for m in msgs]
        time.sleep(0.001)
    write_json(out, {"notifs": notifs})


def _reader(
    inp: IO[bytes], out: IO[bytes], nbytes: int, seed: int, desc: int, reads: int, deadline: float
) -> None:
    """READ the source's buffer ``reads`` times as ``desc``-byte descriptors; time each."""
    head = read_json(inp)
    meta = read_frame(inp)
    agent = _agent("reader")
    dst = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(meta)
    offsets = range(0, nbytes, desc)
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(dst.ctypes.data + o, desc, 0) for o in offsets], "DRAM"
    )
    far = agent.prep_xfer_dlist(remote, [(head["addr"] + o, desc, 0) for o in offsets], "DRAM")
    idx = np.arange(len(offsets), dtype=np.int32)
    xfer = agent.make_prepped_xfer("READ", local, idx, far, idx)
    expected = pattern(nbytes, seed)
    seconds = []
    for i in range(reads):
        dst[:] = 0  # a READ that moved nothing cannot pass the check below
        t0 = time.perf_counter()
        state = agent.transfer(xfer, f"read {i}".encode())
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(xfer)
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"READ {i} ended in state {state}")
        if not np.array_equal(dst, expected):
            raise RuntimeError(f"READ {i}: bytes differ from the source's")
        seconds.append(elapsed)
    backend = agent.query_xfer_backend(xfer)
    write_json(out, {"seconds": seconds, "backend": backend, "descriptors": len(offsets)})


def worker_main(argv: list[str]) -> None:
    """Entry of a child (``--role``): the protocol fd is the original stdout; fd 1 then
    points at stderr for whatever NIXL, UCX or numpy print."""
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["source", "reader"], required=True)
    p.add_argument("--nbytes", type=int, required=True)
    p.add_argument("--desc", type=int, required=True)
    p.add_argument("--reads", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, required=True)
    a = p.parse_args(argv)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    deadline = time.monotonic() + a.timeout
    if a.role == "source":
        _source(inp, out, a.nbytes, a.seed, a.reads, deadline)
    else:
        _reader(inp, out, a.nbytes, a.seed, a.desc, a.reads, deadline)


# --- the parent: place, spawn, relay, measure ---------------------------------------------


@dataclass
class LinkResult:
    """One placement's figures. ``seconds`` are the timed READs (warm-up excluded)."""

    label: str
    nbytes: int
    desc_bytes: int
    seconds: list[float]
    notifs: int  # READ notifications the source received (timed and warm-up)
    backend: str
    read_protocol: str  # what UCX picked for the READ, from UCX_PROTO_INFO
    env: dict[str, str]
    reader_veth_rx_bytes: int | None  # None: not placed in a pair
    stderr_tail: dict[str, str] = field(default_factory=dict)

    @property
    def gbps(self) -> list[float]:
        return [self.nbytes / s / 1e9 for s in self.seconds]

    @property
    def median_gbps(self) -> float:
        return statistics.median(self.gbps)


def ucx_env(transport: Transport, pair: NetnsPair | None, side: Side | None) -> dict[str, str]:
    """UCX settings for a child: ``tcp`` pins UCX to TCP on this side's veth end (or
    ``lo`` outside a pair); ``default`` leaves UCX to choose."""
    if transport == "default":
        return {}
    dev = pair.dev(side) if pair is not None and side is not None else "lo"
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}


def measure_read(
    pair: NetnsPair | None,
    source_side: Side | None,
    reader_side: Side | None,
    *,
    transport: Transport,
    mib: int,
    desc_kib: int,
    repeats: int,
    label: str = "",
    timeout: float = 120.0,
    extra_env: dict[str, str] | None = None,
) -> LinkResult:
    """Spawn a source and a reader, each in its side of ``pair`` (``pair=None``: both in
    this process's own namespace, sides ignored), relay the source's metadata to the
    reader, and return the reader's timings and the source's notification count.

    Bounded: a watchdog kills both children after ``timeout`` seconds, which turns any
    blocked pipe read into an EOF here.
    """
    nbytes, desc = mib << 20, desc_kib << 10
    if nbytes % desc:
        raise ValueError("--mib must be a whole number of descriptors")
    reads = WARMUP + repeats
    common = [
        "--nbytes",
        str(nbytes),
        "--desc",
        str(desc),
        "--reads",
        str(reads),
        "--timeout",
        str(timeout),
    ]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    errs: dict[str, IO[bytes]] = {}
    envs: dict[str, dict[str, str]] = {}
    rx_before = pair.link_bytes(reader_side)[0] if pair and reader_side else None
    with contextlib.ExitStack() as stack:
        for role, side in (("source", source_side), ("reader", reader_side)):
            envs[role] = {**ucx_env(transport, pair, side), **(extra_env or {})}
            # The reader prints UCX's protocol tables (stderr): which transport served it.
            info = {"UCX_PROTO_INFO": "y"} if role == "reader" else {}
            env = {**os.environ, "PYTHONPATH": str(REPO), **info, **envs[role]}
            argv = [sys.executable, "-m", "benchmarks.cluster.nixl_link", "--role", role, *common]
            errs[role] = stack.enter_context(tempfile.TemporaryFile())
            kw: dict[str, Any] = dict(
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[role], env=env, cwd=REPO
            )
            if pair is not None and side is not None:
                procs[role] = pair.popen(side, argv, **kw)
            else:
                procs[role] = subprocess.Popen(argv, **kw)
        for proc in procs.values():
            stack.callback(_reap, proc)
        watchdog = threading.Timer(timeout + 10, _kill_all, [list(procs.values())])
        watchdog.start()
        stack.callback(watchdog.cancel)
        src, rdr = procs["source"], procs["reader"]
        assert src.stdout and src.stdin and rdr.stdout and rdr.stdin
        try:
            write_frame(rdr.stdin, read_frame(src.stdout))  # {"addr", "nbytes"}
            write_frame(rdr.stdin, read_frame(src.stdout))  # agent metadata
            got = read_json(rdr.stdout)
            notifs = read_json(src.stdout)["notifs"]
        except (EOFError, BrokenPipeError, ValueError) as e:
            tails = {r: _tail(f) for r, f in errs.items()}
            raise RuntimeError(f"{label or 'nixl_link'}: {e}\n{tails}") from e
        tails = {r: _tail(f, 800) for r, f in errs.items()}
        protocol = read_protocol(_tail(errs["reader"], None))
    rx = None
    if pair is not None and reader_side is not None and rx_before is not None:
        rx = pair.link_bytes(reader_side)[0] - rx_before
    return LinkResult(
        label=label,
        nbytes=nbytes,
        desc_bytes=desc,
        seconds=got["seconds"][WARMUP:],
        notifs=len(notifs),
        backend=got["backend"],
        read_protocol=protocol,
        env=_merged_env(envs),
        reader_veth_rx_bytes=rx,
        stderr_tail=tails,
    )


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            if pipe:
                pipe.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _tail(f: IO[bytes], n: int | None = 2000) -> str:
    f.seek(0)
    text = f.read().decode(errors="replace")
    return text if n is None else text[-n:]


def _merged_env(envs: dict[str, dict[str, str]]) -> dict[str, str]:
    """The children's UCX settings as one line; a setting that differs per side (the
    device each end is pinned to) is shown as ``source|reader``."""
    keys = dict.fromkeys(k for e in envs.values() for k in e)
    return {k: "|".join(dict.fromkeys(e.get(k, "") for e in envs.values())) for k in keys}


def read_protocol(ucx_log: str) -> str:
    """The rows of UCX's "remote memory read" table for the peer (not the worker's own
    ``self`` loopback config), as "description via transport/device"; "unknown" when the
    UCX build prints no protocol tables."""
    rows: list[str] = []
    in_read = peer = False
    for line in ucx_log.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and "cfg#" in cells[0]:
            peer, in_read = " self " not in f" {cells[0]} ", False
        elif len(cells) == 1 and cells[0].startswith("remote memory read"):
            in_read = peer
        elif in_read and len(cells) == 3 and cells[0] != "Range":
            row = f"{cells[1]} via {cells[2]}"
            if row not in rows:
                rows.append(row)
    return "; ".join(rows) or "unknown"


def run_placement(pair: NetnsPair, placement: str, **kw: Any) -> LinkResult:
    """The two placements this benchmark records (see the module docstring)."""
    if placement == "veth-tcp":
        return measure_read(pair, "a", "b", transport="tcp", label=placement, **kw)
    if placement == "same-host":
        return measure_read(pair, "a", "a", transport="default", label=placement, **kw)
    raise ValueError(placement)


# --- report ---------------------------------------------------------------------------------


def write_report(results: list[LinkResult], out: Path, command: str, repeats: int) -> str:
    machine = describe_machine()
    doc = {
        "command": command,
        "machine": machine,
        "results": [{**asdict(r), "gbps": r.gbps, "median_gbps": r.median_gbps} for r in results],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # portable(): the children's stderr tails may name this checkout's paths.
    out.with_suffix(".json").write_text(portable(json.dumps(doc, indent=2)) + "\n")
    r0 = results[0]
    lines = [
        "# NIXL READ between two processes: across a veth (UCX over TCP) vs one host",
        "",
        f"Command: `{command}`",
        "",
        f"Each placement: the reader READs {r0.nbytes >> 20} MiB from the source as "
        f"{r0.nbytes // r0.desc_bytes} descriptors of {r0.desc_bytes >> 10} KiB in one "
        f"transfer request, checks every byte, {WARMUP} untimed warm-up READ then "
        f"{repeats} timed; the source counts the READ notifications. `veth-tcp`: source "
        "and reader in two network namespaces joined by a veth (`benchmarks.cluster.netns_pair`), "
        "`UCX_TLS=tcp`, `UCX_NET_DEVICES` = each side's veth end. `same-host`: both in one "
        "namespace, UCX's default transports. \"veth rx\" is the reader's veth byte counter "
        "over the whole run (warm-up included): the data crossed the link when it is at "
        "least (1 + repeats) x the buffer. Both processes share this machine's CPUs and "
        "memory: `veth-tcp` measures UCX's TCP path through the kernel (UCX's tcp transport "
        "has no RDMA read, so a READ is emulated by messages), not a network's bandwidth, "
        "and on a machine with few cores the UCX progress threads of both sides compete "
        "with the copies.",
        "",
        "| placement | UCX env (source\\|reader) | READ served by (UCX_PROTO_INFO) "
        "| median GB/s | min / max GB/s | notifications | veth rx MiB |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        env = " ".join(f"{k}={v}" for k, v in r.env.items()) or "(default)"
        rx = "" if r.reader_veth_rx_bytes is None else f"{r.reader_veth_rx_bytes / 2**20:,.1f}"
        env = env.replace("|", "\\|")
        lines.append(
            f"| {r.label} | `{env}` | {r.read_protocol} "
            f"| **{r.median_gbps:.2f}** | {min(r.gbps):.2f} / "
            f"{max(r.gbps):.2f} | {r.notifs} | {rx} |"
        )
    if len(results) == 2 and results[1].median_gbps:
        ratio = results[0].median_gbps / results[1].median_gbps
        lines += ["", f"{results[0].label} / {results[1].label}: **{ratio:.2f}x**."]
    lines += ["", "Machine:", "", "```", machine, "```"]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--role" in argv:
        worker_main(argv)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64, help="buffer size READ each time")
    p.add_argument("--desc-kib", type=int, default=256, help="size of one descriptor")
    p.add_argument("--repeats", type=int, default=5, help="timed READs per placement")
    p.add_argument("--placements", default="veth-tcp,same-host")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per placement")
    p.add_argument("--out", type=Path, default=RESULTS, help="writes <out>.md and <out>.json")
    args = p.parse_args(argv)
    ok, why = available()
    if not ok:
        sys.exit(f"nixl_link needs network namespaces: {why}")
    results = []
    with NetnsPair() as pair:
        for placement in args.placements.split(","):
            results.append(
                run_placement(
                    pair,
                    placement,
                    mib=args.mib,
                    desc_kib=args.desc_kib,
                    repeats=args.repeats,
                    timeout=args.timeout,
                )
            )
    command = portable(" ".join(["python -m benchmarks.cluster.nixl_link", *argv]))
    sys.stdout.write(write_report(results, args.out, command, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
