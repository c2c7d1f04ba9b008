"""The shard loop over real shared-memory rings (one process plays every peer)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from detokenizer.worker import DetokWorker, DetokWorkerConfig
from tests.detokenizer.helpers import one_batch, register, stream_batches
from transport.doorbell import Doorbell
from transport.ring import Ring
from wire.params import DetokParams
from wire.records import AbortRequest, TextBatch, TokenBatch, decode, encode
from wire.rids import owned_rids


@pytest.fixture
def shard(qwen_tokenizer: Any) -> Iterator[tuple[DetokWorker, dict[str, Ring]]]:
    """A shard worker and the other end of each of its rings: control (c), prefill (p),
    decode (d) in; stop (s), frontend (f) out."""
    bell = Doorbell.create()
    made = {
        n: Ring.create(f"test-detok-{n}", 1 << 16, bell if n in "cpd" else None) for n in "cpdsf"
    }
    cfg = DetokWorkerConfig(
        index=0,
        tokenizer_path="",
        doorbell=bell.spec,
        control=(made["c"].spec,),
        prefill_rings=(made["p"].spec,),
        decode_rings=(made["d"].spec,),
        stop_rings=(made["s"].spec,),
        frontends=(made["f"].spec,),
    )
    worker = DetokWorker(cfg, qwen_tokenizer)
    peers = {
        n: Ring.attach(made[n].spec, "producer" if n in "cpd" else "consumer") for n in "cpdsf"
    }
    yield worker, peers
    worker.close()
    for ring in [*peers.values(), *made.values()]:
        ring.close()


def test_worker_moves_tokens_to_text_and_stops_to_the_decode_ring(
    shard: tuple[DetokWorker, dict[str, Ring]], qwen_tokenizer: Any
) -> None:
    worker, peers = shard
    ids = qwen_tokenizer.encode("Hello world. END of it")
    peers["c"].put(encode(register(11, DetokParams(stop=("END",)))))
    batches = stream_batches(11, ids)
    peers["p"].put(encode(batches[0]))
    for b in batches[1:]:
        peers["d"].put(encode(b))
    assert worker.step()
    assert not worker.step()
    (raw,) = peers["f"].drain(16)
    text = decode(raw)
    assert isinstance(text, TextBatch)
    assert text.items[0].text == "Hello world. " and text.items[0].stop_reason == "END"
    assert [decode(r) for r in peers["s"].drain(16)] == [AbortRequest(rid=11)]


def test_prefill_token_text_goes_out_in_its_own_step(
    shard: tuple[DetokWorker, dict[str, Ring]], qwen_tokenizer: Any
) -> None:
    """Time to first token: the first token's text never waits for decode's second token,
    unless it could still begin a stop string."""
    worker, peers = shard
    first = qwen_tokenizer.encode("Hello world")[0]
    assert qwen_tokenizer.decode([first]) == "Hello"
    stops = {1: (), 2: ("zzz",), 3: ("Hello!",)}
    for rid, stop in stops.items():
        peers["c"].put(encode(register(rid, DetokParams(stop=stop))))
        peers["p"].put(encode(one_batch(rid, 0, first)))  # mid-stream: no finish
    assert worker.step()
    (raw,) = peers["f"].drain(16)
    batch = decode(raw)
    assert isinstance(batch, TextBatch)
    assert {d.rid: (d.text, d.token_ids) for d in batch.items} == {
        1: ("Hello", [first]),
        2: ("Hello", [first]),
        3: ("", [first]),  # "Hello" may be the start of "Hello!": held, correctly
    }


def _attach_elsewhere_and_exit(ring: Ring) -> None:
    """Attach ``ring``'s reading side from a process that exits at once: a dead frontend."""
    code = (
        "import json, sys; from transport.ring import Ring, RingSpec\n"
        "Ring.attach(RingSpec(**json.loads(sys.argv[1])), 'consumer')"
    )
    spec = ring.spec
    subprocess.run(
        [sys.executable, "-c", code, spec.to_json()],
        check=True,
        pass_fds=(spec.fd, spec.doorbell_fd, spec.space_fd),
    )


def test_text_goes_to_the_owning_frontend_and_a_dead_ones_requests_are_stopped(
    qwen_tokenizer: Any,
) -> None:
    bell = Doorbell.create()
    names = ("c0", "c1", "d", "s", "f0", "f1")
    made = {
        n: Ring.create(f"test-detok2-{n}", 1 << 16, bell if n[0] in "cd" else None) for n in names
    }
    cfg = DetokWorkerConfig(
        index=0,
        tokenizer_path="",
        doorbell=bell.spec,
        control=(made["c0"].spec, made["c1"].spec),
        prefill_rings=(),
        decode_rings=(made["d"].spec,),
        stop_rings=(made["s"].spec,),
        frontends=(made["f0"].spec, made["f1"].spec),
    )
    worker = DetokWorker(cfg, qwen_tokenizer)
    peers = {
        n: Ring.attach(made[n].spec, "producer" if n[0] in "cd" else "consumer")
        for n in ("c0", "c1", "d", "s", "f0")
    }
    mine, theirs = next(owned_rids(0)), next(owned_rids(1))
    try:
        peers["c0"].put(encode(register(mine, DetokParams())))
        peers["c1"].put(encode(register(theirs, DetokParams())))
        ids = qwen_tokenizer.encode("one two three four")
        for pos in range(2):
            peers["d"].put(encode(TokenBatch.build([mine, theirs], [pos, pos], [ids[pos]] * 2)))
        _attach_elsewhere_and_exit(made["f1"])  # frontend 1 is gone
        while worker.step():
            pass
        texts = [decode(r) for r in peers["f0"].drain(16)]
        assert {d.rid for t in texts for d in t.items} == {mine}  # theirs went nowhere
        # Its request ended here; its decode worker hears so with its next token.
        peers["d"].put(encode(one_batch(theirs, 2, ids[2])))
        while worker.step():
            pass
        assert [decode(r) for r in peers["s"].drain(16)] == [AbortRequest(rid=theirs)]
    finally:
        worker.close()
        for ring in [*peers.values(), *made.values()]:
            ring.close()
