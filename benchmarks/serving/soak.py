"""Soak: mixed load with disconnects and aborts, then check nothing leaked.

The load mixes short and long prompts, short and long generations, streaming and not,
over ``/v1/completions``, ``/v1/chat/completions`` and ``/generate``; some clients drop a
stream after a few chunks, some cancel a request before its answer. After a warm-up the
script waits for the server to go quiet and takes a baseline; after the main run it waits
again and compares. A leak shows as KV blocks still held, more ``pdserve.*`` entries or
bytes in /dev/shm, or open fds / RSS over the launcher's process tree grown by > 10 %.

    python -m benchmarks.serving.soak --duration 600 --out benchmarks/results/soak

launches its own ``launch --prefill 2 --decode 2 --detokenizers 2 --device cpu``;
``--url`` soaks a running server instead (process-tree figures need ``--pid``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.machine import machine_block
from benchmarks.harness.processes import open_fds, process_tree, rss_bytes, shm_segments
from benchmarks.harness.servers import launch
from benchmarks.harness.words import PLAIN_WORDS

logger = logging.getLogger(__name__)

LAUNCH_ARGS = tuple(
    shlex.split(
        "--prefill 2 --decode 2 --detokenizers 2 --device cpu --kv-cache-tokens 16384 "
        "--max-model-len 1024"
    )
)
# n words make about n to 2n tokens (see benchmarks.harness.words), so long prompts stay under
# --max-model-len with room to answer.
WORDS = (
    *PLAIN_WORDS,
    "seven",
    "bright",
    "stars",
    "shine",
    "above",
    "quiet",
    "river",
    "banks",
    "and",
    "old",
    "stone",
    "bridges",
    "carry",
    "travellers",
    "home",
    "before",
    "night",
)
GROWTH_LIMIT = 0.10
BENIGN = frozenset({"ok", "disconnected", "aborted", "503"})


@dataclass(frozen=True)
class SoakConfig:
    url: str
    duration_s: float
    warmup_s: float = 20.0
    concurrency: int = 12
    seed: int = 0
    disconnect_p: float = 0.1  # drop a stream after a few chunks
    abort_p: float = 0.1  # cancel a request at a random moment, streaming or not
    long_prompt_p: float = 0.3
    long_output_p: float = 0.3
    request_timeout_s: float = 120.0


@dataclass(frozen=True)
class Snapshot:
    """Server resources at a quiet moment; ``kv_used`` maps worker name to blocks held."""

    kv_used: dict[str, int]
    shm_entries: int
    shm_segments: int
    shm_segment_bytes: int
    shm_used_bytes: int  # df /dev/shm: machine-wide, includes other users of /dev/shm
    fds: int
    rss_bytes: int
    processes: int


@dataclass
class Tally:
    """Outcomes by kind: ``ok``, ``disconnected``, ``aborted``, ``503``, or an error name.

    ``tokens`` adds completion tokens of whole responses and chunks of streamed ones.
    """

    outcomes: Counter[str] = field(default_factory=Counter)
    by_endpoint: Counter[str] = field(default_factory=Counter)
    tokens: int = 0


# ---- resources -----------------------------------------------------------------------


def kv_used(url: str) -> dict[str, int]:
    workers = httpx.get(url + "/health", timeout=10).json()["workers"]
    out = {}
    for w in workers:
        load = w["load"]
        if "total_kv_blocks" in load:
            out[f"{w['role']}-{w['index']}"] = int(load["total_kv_blocks"] - load["free_kv_blocks"])
    return out


def snapshot(url: str, root_pid: int | None) -> Snapshot:
    pids = process_tree(root_pid) if root_pid is not None else []
    vfs = os.statvfs("/dev/shm")
    segments: dict[int, int] = {}
    for p in pids:
        segments.update(shm_segments(p))
    return Snapshot(
        kv_used=kv_used(url),
        shm_entries=sum(1 for n in os.listdir("/dev/shm") if n.startswith("pdserve.")),
        shm_segments=len(segments),
        shm_segment_bytes=sum(segments.values()),
        shm_used_bytes=(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize,
        fds=sum(open_fds(p) for p in pids),
        rss_bytes=sum(rss_bytes(p) for p in pids),
        processes=len(pids),
    )


def wait_quiet(url: str, timeout_s: float = 60.0) -> dict[str, int]:
    """Poll until no worker holds KV; returns the last reading (non-zero on timeout)."""
    deadline = time.monotonic() + timeout_s
    used = kv_used(url)
    while any(used.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        used = kv_used(url)
    return used


def leaks(before: Snapshot, after: Snapshot) -> list[str]:
    """What grew: KV held at the end, shm entries or segments, or shm/fd/RSS beyond 10 %.

    df /dev/shm is reported but not judged: other servers on the machine move it.
    """
    found = [f"{w} holds {n} KV blocks" for w, n in after.kv_used.items() if n]
    if after.shm_entries > before.shm_entries:
        found.append(f"/dev/shm pdserve.* entries {before.shm_entries} -> {after.shm_entries}")
    if after.shm_segments > before.shm_segments:
        found.append(f"shm segments held {before.shm_segments} -> {after.shm_segments}")
    for name in ("shm_segment_bytes", "fds", "rss_bytes"):
        a, b = getattr(before, name), getattr(after, name)
        if b > a * (1 + GROWTH_LIMIT):
            found.append(f"{name} grew {a} -> {b} (+{100 * (b - a) / max(a, 1):.1f} %)")
    return found


# ---- load ----------------------------------------------------------------------------


def _request(rng: random.Random, cfg: SoakConfig) -> tuple[str, dict[str, object]]:
    """A random (path, body); the prompt and output lengths keep within 1024 tokens."""
    n_words = rng.randint(150, 350) if rng.random() < cfg.long_prompt_p else rng.randint(3, 30)
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    max_tokens = rng.randint(100, 250) if rng.random() < cfg.long_output_p else rng.randint(1, 16)
    stream = rng.random() < 0.5
    sampling = {
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.8]),
        "ignore_eos": rng.random() < 0.5,
    }
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
    if path == "/generate":
        return path, {"text": text, "stream": stream, "sampling_params": sampling}
    body: dict[str, object] = {"stream": stream, **sampling}
    if path == "/v1/completions":
        return path, {"prompt": text, **body}
    return path, {"messages": [{"role": "user", "content": text}], **body}


def _finish(doc: dict[str, object]) -> object:
    """``finish_reason`` of a native or OpenAI-shaped response or chunk."""
    choices = doc.get("choices")
    if isinstance(choices, list) and choices:
        return choices[0].get("finish_reason")
    return doc.get("finish_reason")


async def _one(
    client: httpx.AsyncClient, path: str, body: dict[str, object], drop_after: int | None
) -> tuple[str, int]:
    """Run one request; ``drop_after`` chunks then hang up (streams only)."""
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return str(r.status_code), 0
        doc = r.json()
        if _finish(doc) == "error":
            return "finish_error", 0
        return "ok", int(doc["usage"]["completion_tokens"])
    chunks = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code), 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if _finish(json.loads(line[6:])) == "error":
                return "finish_error", chunks
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return "disconnected", chunks
    return "ok", chunks


async def _client_loop(
    client: httpx.AsyncClient, cfg: SoakConfig, rng: random.Random, deadline: float, tally: Tally
) -> None:
    while time.monotonic() < deadline:
        path, body = _request(rng, cfg)
        drop = rng.randint(1, 6) if body["stream"] and rng.random() < cfg.disconnect_p else None
        abort_at = rng.uniform(0.0, 1.5) if rng.random() < cfg.abort_p else None
        tally.by_endpoint[f"{path} stream={body['stream']}"] += 1
        limit = cfg.request_timeout_s if abort_at is None else abort_at
        try:
            # On timeout wait_for cancels the request, which closes its connection: the
            # server sees the client go, mid-prefill, mid-stream or while it is queued.
            outcome, n = await asyncio.wait_for(_one(client, path, body, drop), limit)
        except TimeoutError:
            outcome, n = ("aborted", 0) if abort_at is not None else ("timeout", 0)
        except httpx.HTTPError as e:
            outcome, n = type(e).__name__, 0
        tally.outcomes[outcome] += 1
        tally.tokens += n
        if outcome == "503":
            await asyncio.sleep(rng.uniform(0.5, 1.0))  # honour Retry-After, roughly


async def run_load(cfg: SoakConfig, seconds: float, seed: int) -> Tally:
    tally = Tally()
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    timeout = httpx.Timeout(cfg.request_timeout_s)
    async with httpx.AsyncClient(base_url=cfg.url, limits=limits, timeout=timeout) as client:
        deadline = time.monotonic() + seconds
        rngs = [random.Random(seed * 1000 + i) for i in range(cfg.concurrency)]
        await asyncio.gather(*(_client_loop(client, cfg, r, deadline, tally) for r in rngs))
    return tally


# ---- driver --------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakResult:
    config: SoakConfig
    warmup: dict[str, object]
    outcomes: dict[str, int]
    by_endpoint: dict[str, int]
    tokens: int
    before: Snapshot
    after: Snapshot
    leaks: list[str]
    wall_s: float

    @property
    def errors(self) -> dict[str, int]:
        """Outcomes that are failures: not ok, a deliberate disconnect/abort, or a 503."""
        return {k: v for k, v in self.outcomes.items() if k not in BENIGN}


def soak(cfg: SoakConfig, root_pid: int | None) -> SoakResult:
    """Warm up, take a quiet baseline, run the main load, wait quiet, compare."""
    warm = asyncio.run(run_load(cfg, cfg.warmup_s, cfg.seed + 1))
    wait_quiet(cfg.url)
    time.sleep(1.0)  # closed connections' fds go once the server's loop has run
    before = snapshot(cfg.url, root_pid)
    t0 = time.monotonic()
    tally = asyncio.run(run_load(cfg, cfg.duration_s, cfg.seed))
    wall = time.monotonic() - t0
    wait_quiet(cfg.url)
    time.sleep(1.0)
    after = snapshot(cfg.url, root_pid)
    warmup: dict[str, object] = {"outcomes": dict(warm.outcomes)}
    outcomes, by_endpoint = dict(tally.outcomes), dict(tally.by_endpoint)
    found = leaks(before, after)
    return SoakResult(cfg, warmup, outcomes, by_endpoint, tally.tokens, before, after, found, wall)


def _resource_rows(b: Snapshot, a: Snapshot) -> list[str]:
    def mib(x: int) -> str:
        return f"{x / 2**20:.1f}"

    rows = [
        ("KV blocks held, total over workers", sum(b.kv_used.values()), sum(a.kv_used.values())),
        ("/dev/shm pdserve.* entries", b.shm_entries, a.shm_entries),
        ("shm segments held by the tree", b.shm_segments, a.shm_segments),
        ("shm segment MiB held by the tree", mib(b.shm_segment_bytes), mib(a.shm_segment_bytes)),
        ("df /dev/shm used MiB (machine-wide)", mib(b.shm_used_bytes), mib(a.shm_used_bytes)),
        ("open fds, process tree", b.fds, a.fds),
        ("RSS MiB, process tree", mib(b.rss_bytes), mib(a.rss_bytes)),
        ("processes in tree", b.processes, a.processes),
    ]
    head = ["| resource (quiet server) | after warm-up | after soak |", "| --- | --- | --- |"]
    return head + [f"| {name} | {x} | {y} |" for name, x, y in rows]


def write_report(res: SoakResult, out: Path, command: str) -> None:
    """``out``.json with every figure, ``out``.md with the tables."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = asdict(res)
    doc["command"], doc["machine"] = command, describe_machine()
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    total = sum(res.outcomes.values())
    lines = [
        "# Soak: mixed load with disconnects and aborts",
        "",
        f"Command: `{command}`",
        "",
        *machine_block(),
        f"Main run: {res.wall_s:.0f} s, {total} requests ({total / res.wall_s:.1f}/s), "
        f"{res.tokens} tokens (whole responses) + chunks (streams) received, "
        f"concurrency {res.config.concurrency}; "
        f"warm-up {res.config.warmup_s:.0f} s: {res.warmup['outcomes']}.",
        "",
        "| outcome | count |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(res.outcomes.items())),
        "",
        "| endpoint | requests |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(res.by_endpoint.items())),
        "",
        *_resource_rows(res.before, res.after),
        "",
        f"Per worker KV held after: {res.after.kv_used}",
        "",
        "Leaks (KV held, new shm entries, > 10 % growth): " + ("; ".join(res.leaks) or "none"),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="main run, seconds")
    p.add_argument("--warmup", type=float, default=30.0, help="warm-up before the baseline")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="soak this server instead of launching one")
    p.add_argument("--pid", type=int, help="with --url: the launcher's pid, for fds/RSS")
    p.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args, launch_args = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = launch(launch_args or list(LAUNCH_ARGS))
        pid = proc.pid
    cfg = SoakConfig(
        url=url,
        duration_s=args.duration,
        warmup_s=args.warmup,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    try:
        res = soak(cfg, pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    logger.info("outcomes %s; leaks %s", res.outcomes, res.leaks or "none")
    if args.out is not None:
        write_report(
            res, args.out, "python -m benchmarks.serving.soak " + " ".join(argv or sys.argv[1:])
        )
    return 1 if res.leaks or res.errors else 0


if __name__ == "__main__":
    sys.exit(main())
