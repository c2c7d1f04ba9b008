"""Several hosts, stood in for by two network namespaces joined by a veth
(``benchmarks/cluster/netns_pair.py``): a head node (frontend, prefill, detokenizer) in ``a`` and
member nodes (decode) in ``b``. KV crosses by NIXL, UCX over TCP on the veth; records on
the authenticated cluster link. Traffic stays inside the two namespaces, which are
deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.cluster.netns_pair import NetnsLaunch, NetnsPair, Side, available
from bundled_models import tiny
from engine.config import ModelConfig
from tests.e2e.helpers import check_exact, children, random_prompts, title

ok, why = available()
if not ok:  # pragma: no cover - root with network namespaces is the norm here and in CI
    pytest.skip(f"two network namespaces cannot be made here: {why}", allow_module_level=True)
try:
    from transport.nixl_agent import load_nixl

    load_nixl()
except Exception as e:  # pragma: no cover - the test extra installs it
    pytest.skip(f"NIXL is not installed: {e}", allow_module_level=True)

KEY = "a-shared-cluster-key-for-tests"
PORT = 8000  # the head's HTTP port, on its namespace's loopback
CLUSTER_PORT = 7481


class Node(NetnsLaunch):
    """A node of the test's cluster: ``launch`` on CPU with small pools."""

    def __init__(self, pair: NetnsPair, side: Side, args: list[str], model: Path) -> None:
        super().__init__(
            pair,
            side,
            [
                "--model",
                str(model),
                *shlex.split("--device cpu --kv-cache-tokens 4096 --max-model-len 1024"),
                *args,
            ],
        )

    def worker(self, role: str) -> tuple[str, int]:
        """(title, pid) of this node's one worker of ``role``."""
        return next(
            (title(p), p)
            for p in children(self.proc.pid)
            if title(p).startswith(f"pdserve:{role}-")
        )


def start_streams(pair: NetnsPair, prompts: list[list[int]]) -> subprocess.Popen[str]:
    """``tests.e2e.cluster_client`` streaming ``prompts`` to the head from inside namespace
    a; it prints ``started`` once tokens flow, then one JSON line of results."""
    client = pair.popen(
        "a",
        [sys.executable, "-m", "tests.e2e.cluster_client", f"http://127.0.0.1:{PORT}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None
    client.stdin.write(json.dumps(prompts))
    client.stdin.close()
    return client


@dataclass
class Cluster:
    pair: NetnsPair
    model: Path
    head: Node
    members: list[Node]

    @property
    def join(self) -> str:
        return f"{self.pair.addr('a')}:{CLUSTER_PORT}"

    def stream(
        self,
        prompts: list[list[int]],
        kill: int | None = None,
        during: Callable[[], None] | None = None,
    ) -> list[dict]:  # type: ignore[type-arg]
        """Greedy streams of ``prompts`` from inside namespace a; SIGKILL ``kill``, or run
        ``during``, once tokens flow."""
        client = start_streams(self.pair, prompts)
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "started"
        if kill is not None:
            os.kill(kill, signal.SIGKILL)
        if during is not None:
            during()
        out = client.stdout.readline()
        client.wait(30)
        return json.loads(out)  # type: ignore[no-any-return]

    def get(self, path: str) -> tuple[int, str]:
        """(status, body) of ``GET path`` on the head, from inside namespace a."""
        done = self.pair.run(
            "a",
            [
                sys.executable,
                "-m",
                "tests.e2e.cluster_client",
                f"http://127.0.0.1:{PORT}",
                "get",
                path,
            ],
            timeout=30,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        status, _, body = done.stdout.partition("\n")
        return int(status), body


def _start(
    pair: NetnsPair, model: Path, members: int, extra: list[str], head: Sequence[str] = ()
) -> Cluster:
    """A head in ``a`` (one prefill worker unless ``head`` says otherwise) and ``members``
    decode nodes of one worker each in ``b``; ``extra`` flags go to every node."""
    head_node = Node(
        pair,
        "a",
        [
            *shlex.split("--prefill 1 --decode 0 --remote-decode"),
            str(members),
            "--advertise",
            f"{pair.addr('a')}:{CLUSTER_PORT}",
            "--cluster-key",
            KEY,
            "--node-name",
            "a",
            "--port",
            str(PORT),
            *extra,
            *head,
        ],
        model,
    )
    join = [
        *shlex.split("--prefill 0 --decode 1 --join"),
        f"{pair.addr('a')}:{CLUSTER_PORT}",
        "--cluster-key",
        KEY,
    ]
    nodes = [
        Node(pair, "b", [*join, "--node-name", f"b{m}", *extra], model) for m in range(members)
    ]
    for node in nodes:
        node.wait_for("pdserve node")
    head_node.wait_for("pdserve is serving")
    return Cluster(pair, model, head_node, nodes)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head (1 prefill) and two decode nodes of one worker each, the tiny model."""
    with NetnsPair() as pair:
        c = _start(pair, tiny.tiny_model_dir(tiny.DEFAULT_ARCH), 2, [])
        try:
            yield c
        finally:
            for node in (*c.members, c.head):
                node.stop()


def _kv_bytes(model: Path, prompts: list[list[int]], block: int = 16) -> int:
    cfg = ModelConfig.from_pretrained(model)
    per_block = cfg.num_layers * 2 * block * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    return sum(-(-len(p) // block) * per_block for p in prompts)


def test_prefill_on_one_host_decode_on_another_is_exact(
    cluster: Cluster,
    reference: dict,  # type: ignore[type-arg]
    qwen_tokenizer: object,
) -> None:
    prompts = random_prompts(6, seed=11)
    rx0, _ = cluster.pair.link_bytes("b")
    results = cluster.stream(prompts)
    rx1, _ = cluster.pair.link_bytes("b")
    log = cluster.head.log + [line for m in cluster.members for line in m.log]
    check_exact(results, prompts, reference, cluster.model, qwen_tokenizer, log)
    # The handoffs' KV crossed the veth (with headers on top): the decode nodes have no
    # shared pool to copy from, only the NIXL handle each mapped.
    assert rx1 - rx0 >= _kv_bytes(cluster.model, prompts)
    for node in cluster.members:
        assert any("mapped prefill 0's KV pool" in line for line in node.log)
    _check_nodes_named(cluster)
    _check_listeners(cluster)


def _check_listeners(cluster: Cluster) -> None:
    """Every socket a node listens on is on its cluster address (or loopback: the head's
    HTTP port here): NIXL's UCX was told the interface, by the launcher."""
    for side in ("a", "b"):
        ss = cluster.pair.run(side, ["ss", "-Htlnp"], timeout=10)
        assert ss.returncode == 0, ss.stderr
        bound = [line.split()[3] for line in ss.stdout.splitlines() if "pdserve" in line]
        assert bound, ss.stdout
        allowed = (f"{cluster.pair.addr(side)}:", "127.0.0.1:")
        assert all(b.startswith(allowed) for b in bound), ss.stdout
        node = cluster.head if side == "a" else cluster.members[0]
        assert any(f"on interface {cluster.pair.dev(side)}" in line for line in node.log)


def _check_nodes_named(cluster: Cluster) -> None:
    """The head's /health and /metrics name each worker's node: its own for the prefill
    worker, shard and frontend; the member that brought it for each remote decode worker
    (which member got which index depends on who joined first)."""
    status, body = cluster.get("/health")
    health = json.loads(body)
    assert (status, health["status"]) == (200, "ok"), body
    nodes = {(w["role"], w["index"]): w["node"] for w in health["workers"]}
    assert nodes[("prefill", 0)] == nodes[("detokenizer", 0)] == nodes[("frontend", 0)] == "a"
    assert {nodes[("decode", 0)], nodes[("decode", 1)]} == {"b0", "b1"}, body
    assert health["nodes"] == {
        "a": {"workers": 3, "alive": 3},
        "b0": {"workers": 1, "alive": 1},
        "b1": {"workers": 1, "alive": 1},
    }
    _, metrics = cluster.get("/metrics")
    for index in (0, 1):
        labels = f'index="{index}",node="{nodes[("decode", index)]}",role="decode"'
        assert f"pdserve_num_requests_running{{{labels}}}" in metrics, metrics
    assert 'pdserve_num_requests_running{index="0",node="a",role="prefill"}' in metrics


def test_a_killed_decode_worker_on_one_node_its_streams_finish_on_the_other(
    cluster: Cluster,
    reference: dict,  # type: ignore[type-arg]
    qwen_tokenizer: object,
) -> None:
    name, victim = cluster.members[0].worker("decode")
    prompts = random_prompts(8, seed=12)
    results = cluster.stream(prompts, kill=victim)
    log = cluster.head.log + [line for m in cluster.members for line in m.log]
    check_exact(results, prompts, reference, cluster.model, qwen_tokenizer, log)
    assert any("resumed" in line for line in cluster.head.log)  # it did hold streams
    restarted = f"started {name.removeprefix('pdserve:')}"
    cluster.members[0].wait_for(restarted, 30)  # its node restarted it


def test_after_the_heads_gateway_restarts_the_members_join_again_and_serve_exactly(
    cluster: Cluster,
    reference: dict,  # type: ignore[type-arg]
    qwen_tokenizer: object,
) -> None:
    """A restarted head gateway knows no member: each notices the head's silence, joins
    again under the indices its workers run with, and decode across hosts resumes."""
    name, gateway = cluster.head.worker("gateway")
    before = [len(m.log) for m in cluster.members]
    os.kill(gateway, signal.SIGKILL)
    cluster.head.wait_for(f"started {name.removeprefix('pdserve:')}", 30)
    deadline = time.monotonic() + 60
    for m, start in zip(cluster.members, before, strict=True):
        while not any(
            "the head admits this node's decode workers" in line for line in m.log[start:]
        ):
            assert time.monotonic() < deadline, "".join(m.log[-20:])
            time.sleep(0.2)
    # Until the new gateway mirrors their rows again, the remote workers are not routable.
    while True:
        health = json.loads(cluster.get("/health")[1])
        if all(w["alive"] for w in health["workers"]):
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    prompts = random_prompts(4, seed=13)
    results = cluster.stream(prompts)
    log = cluster.head.log + [line for m in cluster.members for line in m.log]
    check_exact(results, prompts, reference, cluster.model, qwen_tokenizer, log)


def test_streams_cut_off_by_a_partition_finish_exactly_once_it_heals(
    cluster: Cluster,
    reference: dict,  # type: ignore[type-arg]
    qwen_tokenizer: object,
) -> None:
    """The veth goes down mid-stream for longer than the head waits on a silent node: its
    decode workers read as dead, their streams wait to be resumed (none hangs, none is
    failed yet); once the link is back the members are heard again and every stream
    finishes, exact."""
    prompts = random_prompts(4, seed=14)

    def cut() -> None:
        cluster.pair.set_link(False)
        try:
            time.sleep(8)  # past the head's 5 s silence bound
        finally:
            cluster.pair.set_link(True)

    start = len(cluster.head.log)
    results = cluster.stream(prompts, during=cut)
    log = cluster.head.log + [line for m in cluster.members for line in m.log]
    check_exact(results, prompts, reference, cluster.model, qwen_tokenizer, log)
    said = cluster.head.log[start:]
    assert any("silent for" in line for line in said), "".join(said[-30:])
    assert any("resumed" in line for line in said), "".join(said[-30:])


def test_a_node_with_another_cluster_key_is_refused(cluster: Cluster) -> None:
    intruder = Node(
        cluster.pair,
        "b",
        [
            *shlex.split("--prefill 0 --decode 1 --join"),
            cluster.join,
            *shlex.split("--cluster-key not-the-cluster-key-at-all --node-name intruder"),
        ],
        cluster.model,
    )
    assert intruder.proc.wait(60) == 2
    said = "".join(intruder.log)
    assert "refused" in said or "--cluster-key" in said, said
    deadline = time.monotonic() + 10
    while not any("transport.link" in line and "WARNING" in line for line in cluster.head.log):
        assert time.monotonic() < deadline, "".join(cluster.head.log[-20:])
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    return {}


@pytest.mark.slow
def test_smollm2_across_two_hosts_equals_transformers() -> None:
    """The default model in float32 (--quantization none), prefill on one host and decode
    on the other: transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bundled_models.default_model import default_model_dir

    path = default_model_dir()
    questions = ["What is the capital of France?", "Name three colours."]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    with NetnsPair() as pair:
        c = _start(pair, path, 1, ["--quantization", "none"])
        try:
            client = pair.run(
                "a",
                [
                    sys.executable,
                    "-m",
                    "tests.e2e.cluster_client",
                    f"http://127.0.0.1:{PORT}",
                    "chat",
                    path.name,
                    "24",
                ],
                timeout=300,
                input=json.dumps(conversations),
            )
        finally:
            for node in (*c.members, c.head):
                node.stop()
    assert client.returncode == 0, client.stderr[-2000:]
    served = json.loads(client.stdout.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for messages, got in zip(conversations, served, strict=True):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        want = ref[0, len(ids) :].tolist()
        n = len(got)
        assert got == want[:n] and (n == len(want) or want[n - 1] in tok.all_special_ids)
