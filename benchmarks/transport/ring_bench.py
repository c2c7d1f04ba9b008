"""Shared-memory rings vs ZeroMQ PUSH/PULL + pickle for decode-step outputs.

The baseline is what SGLang's managers do: the scheduler turns each step's tensors into
per-request Python lists (``BatchTokenIDOut``-style) and ``send_pyobj``s them over
``ipc://``; the detokenizer ``recv_pyobj``s. The ring sends ``records.TokenBatch``
columns and the consumer ``records.decode``s them. Both producers start from the same
numpy arrays, both consumers block in the kernel while idle, both sides are real processes.

    python -m benchmarks.transport.ring_bench [--quick]

Writes benchmarks/results/transport_ring.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from benchmarks.harness.machine import machine_block
from transport.doorbell import Doorbell
from transport.ring import Ring
from wire import records

RESULTS = Path(__file__).resolve().parents[1] / "results" / "transport_ring.md"
_TS = struct.Struct("<q")  # send time (CLOCK_MONOTONIC ns, shared by all processes)


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    top_k: int
    messages: int  # throughput phase
    paced: int  # latency phase: one message at a time, consumer asleep in between
    codec: bool = True  # False: pre-encoded bytes, no decode (the transport alone)


def step_arrays(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, k = case.batch, case.top_k
    return {
        "rids": np.arange(b, dtype=np.int64) + 10_000,
        "positions": rng.integers(0, 2000, b, dtype=np.int32),
        "token_ids": rng.integers(0, 150_000, b, dtype=np.int32),
        "logprobs": -rng.random(b, dtype=np.float32) if k else np.full(b, np.nan, np.float32),
        "finish": np.zeros(b, dtype=np.int8),
        "top_ids": rng.integers(0, 150_000, (b, k), dtype=np.int32),
        "top_logprobs": -rng.random((b, k), dtype=np.float32),
    }


def ring_encode(a: dict[str, np.ndarray]) -> bytes:
    return records.encode(records.TokenBatch(**a))


def zmq_encode(a: dict[str, np.ndarray]) -> bytes:
    k = a["top_ids"].shape[1]
    out = {  # per-request lists, as BatchTokenIDOut carries them
        "rids": [str(r) for r in a["rids"].tolist()],
        "finished_reasons": [None] * len(a["rids"]),
        "output_ids": [[t] for t in a["token_ids"].tolist()],
        "read_offsets": a["positions"].tolist(),
        "output_token_logprobs_val": [[v] for v in a["logprobs"].tolist()] if k else [],
        "output_top_logprobs_val": [[r] for r in a["top_logprobs"].tolist()] if k else [],
        "output_top_logprobs_idx": [[r] for r in a["top_ids"].tolist()] if k else [],
    }
    return pickle.dumps(out)


def produce(send: Callable[[bytes], None], case: Case, encode: Callable[..., bytes]) -> None:
    arrays = step_arrays(case)
    if not case.codec:
        payload = encode(arrays)
        encode = lambda _: payload  # noqa: E731
    for _ in range(case.messages):
        send(_TS.pack(time.monotonic_ns()) + encode(arrays))
    for _ in range(case.paced):
        time.sleep(0.0005)  # consumer goes back to sleep between messages
        send(_TS.pack(time.monotonic_ns()) + encode(arrays))


def consume(recv: Callable[[], list[bytes]], case: Case, decode: Callable[[bytes], object]) -> dict:
    """Decode every message; throughput over the burst, latency over the paced tail."""
    stamps: list[tuple[int, int]] = []  # (sent, decoded) per message, monotonic ns
    while len(stamps) < case.messages + case.paced:
        for msg in recv():
            if case.codec:
                decode(msg[_TS.size :])
            stamps.append((_TS.unpack_from(msg)[0], time.monotonic_ns()))
    result: dict = {}
    if case.messages:
        burst = stamps[: case.messages]
        result["msgs_s"] = case.messages / ((burst[-1][1] - burst[0][0]) / 1e9)
    if case.paced:
        lat = np.array([d - s for s, d in stamps[case.messages :]]) / 1e3
        result["p50_us"], result["p99_us"] = np.percentile(lat, [50, 99]).tolist()
    return result


def ring_child(role: str, spec_json: str, bell_json: str, case: Case) -> dict | None:
    from transport.doorbell import DoorbellSpec
    from transport.ring import RingSpec

    spec = RingSpec.from_json(spec_json)
    if role == "producer":
        ring = Ring.attach(spec, "producer")
        produce(lambda b: ring.put(b, timeout=60), case, ring_encode)
        return None
    bell = Doorbell.attach(DoorbellSpec.from_json(bell_json))
    ring = Ring.attach(spec, "consumer", bell)

    def recv() -> list[bytes]:
        got = ring.drain(256)
        while not got:
            bell.wait([ring], timeout=1.0)
            got = ring.drain(256)
        return got

    return consume(recv, case, records.decode)


def zmq_child(role: str, addr: str, case: Case) -> dict | None:
    ctx = zmq.Context()
    if role == "producer":
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addr)
        produce(sock.send, case, zmq_encode)
        sock.close(linger=-1)
        return None
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    print("ready", flush=True)
    return consume(lambda: [sock.recv()], case, pickle.loads)


def idle_child(spec_json: str, bell_json: str, seconds: float) -> dict:
    """A consumer with nothing to read: how much CPU does waiting cost?"""
    from transport.doorbell import DoorbellSpec
    from transport.ring import RingSpec

    bell = Doorbell.attach(DoorbellSpec.from_json(bell_json))
    ring = Ring.attach(RingSpec.from_json(spec_json), "consumer", bell)
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        bell.wait([ring], timeout=1.0)
    return {"cpu_pct": 100 * (time.process_time() - cpu0) / (time.monotonic() - t0)}


def _spawn(args: list[str], fds: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "benchmarks.transport.ring_bench", "--child", json.dumps(args)]
    return subprocess.Popen(cmd, pass_fds=fds, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str]) -> dict:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed with {proc.returncode}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def run_ring(case: Case) -> dict:
    bell = Doorbell.create()
    ring = Ring.create(f"bench{case.batch}", 1 << 22, bell)
    fds = (ring.spec.fd, ring.spec.doorbell_fd, ring.spec.space_fd)
    common = [ring.spec.to_json(), bell.spec.to_json(), json.dumps(case.__dict__)]
    consumer = _spawn(["ring", "consumer", *common], fds)
    producer = _spawn(["ring", "producer", *common], fds)
    producer.wait()
    return _result(consumer)


def run_zmq(case: Case) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        addr = f"ipc://{tmp}/bench.sock"
        consumer = _spawn(["zmq", "consumer", addr, json.dumps(case.__dict__)])
        assert consumer.stdout is not None and consumer.stdout.readline().strip() == "ready"
        producer = _spawn(["zmq", "producer", addr, json.dumps(case.__dict__)])
        producer.wait()
        return _result(consumer)


def run_idle(seconds: float) -> dict:
    bell = Doorbell.create()
    ring = Ring.create("bench-idle", 1 << 12, bell)
    fds = (ring.spec.fd, ring.spec.doorbell_fd, ring.spec.space_fd)
    return _result(_spawn(["idle", ring.spec.to_json(), bell.spec.to_json(), str(seconds)], fds))


def both_phases(run: Callable[[Case], dict], case: Case) -> dict:
    """Burst and paced runs are separate sessions so paced messages never queue."""
    burst = run(dataclasses.replace(case, paced=0))
    return {**burst, **run(dataclasses.replace(case, messages=0))}


def child_main(args: list[str]) -> None:
    kind = args[0]
    if kind == "idle":
        result: dict | None = idle_child(args[1], args[2], float(args[3]))
    elif kind == "ring":
        result = ring_child(args[1], args[2], args[3], Case(**json.loads(args[4])))
    else:
        result = zmq_child(args[1], args[2], Case(**json.loads(args[3])))
    if result is not None:
        print(json.dumps(result), flush=True)


def report(rows: list[tuple[Case, dict, dict]], idle: dict, cmd: str) -> str:
    lines = [
        "# Message rings vs ZeroMQ PUSH/PULL + pickle (ipc://)",
        "",
        f"Command: `{cmd}`",
        "",
        "| case | transport | msgs/s | tokens/s | p50 one-way µs | p99 one-way µs |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for case, ring, zq in rows:
        for name, r in (("shm ring + TokenBatch", ring), ("zmq + pickle", zq)):
            lines.append(
                f"| {case.name} | {name} | {r['msgs_s']:,.0f} | {r['msgs_s'] * case.batch:,.0f} "
                f"| {r['p50_us']:.1f} | {r['p99_us']:.1f} |"
            )
        lines.append(
            f"| {case.name} | **ratio ring/zmq** | **{ring['msgs_s'] / zq['msgs_s']:.1f}x** | "
            f"| {ring['p50_us'] / zq['p50_us']:.2f} | **{ring['p99_us'] / zq['p99_us']:.2f}** |"
        )
    lines += [
        "",
        f"Idle blocked ring consumer: {idle['cpu_pct']:.3f} % of one core (measured over "
        f"{idle['seconds']:.0f} s with `time.process_time`).",
        "",
        "Throughput: a burst of messages, producer and consumer each in its own process, "
        "consumer decoding every record. Latency: send time to decoded-at-consumer time, one "
        "message every ~0.5 ms so the consumer is asleep in the kernel (eventfd / zmq poll) "
        "when each message arrives.",
        "",
        *machine_block(),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages (smoke run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return
    scale = 10 if args.quick else 1
    cases = [
        Case("32 req x 1 token", 32, 0, 100_000 // scale, 4000 // scale),
        Case("256 req + top-20 logprobs", 256, 20, 5000 // scale, 2000 // scale),
        Case("32 req, transport only (no codec)", 32, 0, 100_000 // scale, 4000 // scale, False),
    ]
    rows = [(case, both_phases(run_ring, case), both_phases(run_zmq, case)) for case in cases]
    idle_s = 1.0 if args.quick else 5.0
    idle = {**run_idle(idle_s), "seconds": idle_s}
    cmd = "python -m benchmarks.transport.ring_bench" + (" --quick" if args.quick else "")
    text = report(rows, idle, cmd)
    RESULTS.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
