"""A prefill worker dies after handing off and before its KV was read across hosts: the
read fails cleanly and the request is prefilled again on the other prefill worker,
its stream exact. Two network namespaces stand for the hosts (``test_cluster.py``)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

from benchmarks.cluster.netns_pair import NetnsPair
from bundled_models import tiny
from tests.e2e.helpers import check_exact, children, random_prompts, title
from tests.e2e.test_cluster import Cluster, _start, start_streams

_COMPUTED = "pdserve_prefill_computed_tokens_total{"


def _prefilled_by(cluster: Cluster) -> int | None:
    """The head's prefill worker that has computed a prompt, from its /metrics."""
    for line in cluster.get("/metrics")[1].splitlines():
        if line.startswith(_COMPUTED) and 'role="prefill"' in line and float(line.split()[-1]):
            index = re.search(r'index="(\d+)"', line)
            assert index is not None, line
            return int(index.group(1))
    return None


def test_a_prefill_worker_killed_before_its_kv_was_read_is_prefilled_again_elsewhere(
    qwen_tokenizer: object,
) -> None:
    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    prompts = random_prompts(3, seed=31)[2:]  # one prompt of 23 tokens
    with NetnsPair() as pair:
        c = _start(pair, model, 1, [], head=["--prefill", "2"])
        try:
            _, decode = c.members[0].worker("decode")
            os.kill(decode, signal.SIGSTOP)  # the handoff waits, unread, on the decode node
            try:
                client = start_streams(pair, prompts)
                assert client.stdout is not None
                deadline = time.monotonic() + 30
                while (victim := _prefilled_by(c)) is None:
                    assert time.monotonic() < deadline, "no prefill worker computed the prompt"
                    time.sleep(0.1)
                pid = next(
                    p for p in children(c.head.proc.pid) if title(p) == f"pdserve:prefill-{victim}"
                )
                os.kill(pid, signal.SIGKILL)
            finally:
                os.kill(decode, signal.SIGCONT)
            said = client.stdout.readline().strip()
            assert said == "started", "".join(c.head.log[-40:] + c.members[0].log[-40:])
            results = json.loads(client.stdout.readline())
            client.wait(30)
        finally:
            for node in (*c.members, c.head):
                node.stop()
    log = c.head.log + c.members[0].log
    check_exact(results, prompts, {}, model, qwen_tokenizer, log)
    # The decode node's failed READ or the head's own watchdog, whichever is first, has the
    # request resumed; on the prefill worker that is left.
    resumed = [line for line in c.head.log if "resumed as rid" in line]
    assert resumed and f"prefill {1 - victim}" in resumed[-1], "".join(c.head.log[-30:])
