"""The shard loop over real shared-memory rings (one process plays every peer)."""

from __future__ import annotations

from typing import Any

from detokenizer.worker import DetokWorker, DetokWorkerConfig
from tests.detokenizer.helpers import register, stream_batches
from transport.doorbell import Doorbell
from transport.records import AbortRequest, DetokParams, TextBatch, decode, encode
from transport.ring import Ring


def test_worker_moves_tokens_to_text_and_stops_to_the_decode_ring(qwen_tokenizer: Any) -> None:
    bell = Doorbell.create()
    made = {
        n: Ring.create(f"test-detok-{n}", 1 << 16, bell if n in "cpd" else None) for n in "cpdsf"
    }
    cfg = DetokWorkerConfig(
        index=0,
        tokenizer_path="",
        doorbell=bell.spec,
        control=made["c"].spec,
        prefill_rings=(made["p"].spec,),
        decode_rings=(made["d"].spec,),
        stop_rings=(made["s"].spec,),
        frontend=made["f"].spec,
    )
    worker = DetokWorker(cfg, qwen_tokenizer)
    peers = {
        n: Ring.attach(made[n].spec, "producer" if n in "cpd" else "consumer") for n in "cpdsf"
    }
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
    worker.close()
    for ring in [*peers.values(), *made.values()]:
        ring.close()
