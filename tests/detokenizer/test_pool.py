"""A pool of K=3 shards fed by several prefill and decode workers, as the rings would."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np

from detokenizer.routing import shard_for
from detokenizer.shard import DetokShard
from tests.detokenizer.helpers import QWEN_IDS, oracle, register, stop_oracle
from wire.params import DetokParams
from wire.records import Finish, TokenBatch, decode, encode

K, PREFILL, DECODE, REQUESTS = 3, 2, 3, 300


def test_routing_is_crc32_of_little_endian_rid_and_spreads_evenly() -> None:
    import zlib

    assert shard_for(12345, 7) == zlib.crc32((12345).to_bytes(8, "little")) % 7
    counts = Counter(shard_for(rid, K) for rid in range(30_000))
    assert max(counts.values()) / min(counts.values()) < 1.05


def _requests(rng: random.Random, tokenizer: Any) -> list[dict[str, Any]]:
    words = ["alpha", " beta", "中文", "😀", " stop", "!", "\n", "<|im_end|>"]
    reqs = []
    for _ in range(REQUESTS):
        n = rng.randint(5, 40)
        if rng.random() < 0.5:
            ids = [rng.randrange(QWEN_IDS + 100) for _ in range(n)]
        else:
            ids = tokenizer.encode("".join(rng.choice(words) for _ in range(n)))[:n]
        stop = (" stop",) if rng.random() < 0.3 else ()
        reqs.append(
            {
                "rid": rng.getrandbits(63),
                "ids": ids,
                "prefill": rng.randrange(PREFILL),
                "decode": rng.randrange(DECODE),
                "params": DetokParams(stop=stop),
            }
        )
    return reqs


def _split_by_shard(rows: list[tuple[int, int, int, int]]) -> dict[int, bytes]:
    """One engine step's rows -> one encoded TokenBatch per detokenizer shard."""
    per_shard: dict[int, list[tuple[int, int, int, int]]] = {}
    for row in rows:
        per_shard.setdefault(shard_for(row[0], K), []).append(row)
    batches = {}
    for k, part in per_shard.items():
        rids, positions, token_ids, finish = (list(col) for col in zip(*part))
        batches[k] = encode(TokenBatch.build(rids, positions, token_ids, finish=finish))
    return batches


def _engine_records(reqs: list[dict[str, Any]], rng: random.Random) -> list[tuple[Any, int, bytes]]:
    """(source decode worker or None, shard, record) in a realistic, shuffled arrival order."""
    out: list[tuple[Any, int, bytes]] = []
    for i in range(PREFILL):  # prefill steps: first tokens
        rows = [
            (r["rid"], 0, r["ids"][0], int(len(r["ids"]) == 1)) for r in reqs if r["prefill"] == i
        ]
        out += [(None, k, rec) for k, rec in _split_by_shard(rows).items()]
    for step in range(1, 40):
        for j in range(DECODE):
            rows = [
                (r["rid"], step, r["ids"][step], int(Finish.LENGTH) * (step == len(r["ids"]) - 1))
                for r in reqs
                if r["decode"] == j and step < len(r["ids"])
            ]
            out += [(j, k, rec) for k, rec in _split_by_shard(rows).items()]
    # Rings from different workers are drained in any interleaving: shuffle within windows.
    for start in range(0, len(out), 12):
        window = out[start : start + 12]
        rng.shuffle(window)
        out[start : start + 12] = window
    return out


def test_three_shards_serve_many_requests_exactly_with_even_load(qwen_tokenizer: Any) -> None:
    rng = random.Random(1234)
    reqs = _requests(rng, qwen_tokenizer)
    shards = [DetokShard(qwen_tokenizer)]
    shards += [DetokShard(qwen_tokenizer, table=shards[0].table) for _ in range(K - 1)]
    for r in reqs:
        shards[shard_for(r["rid"], K)].register(register(r["rid"], r["params"]))
    out: dict[int, list[Any]] = {}
    load = Counter[int]()
    notified: list[tuple[int, int]] = []
    for source, k, record in _engine_records(reqs, rng):
        batch = decode(bytes(record))
        assert isinstance(batch, TokenBatch)
        load[k] += batch.size
        shards[k].on_tokens(batch, source)
        text_batch, stops = shards[k].take_outputs()
        notified += [(j, msg.rid) for j, msg in stops]
        if text_batch is not None:
            collect_from = decode(encode(text_batch))
            for delta in collect_from.items:  # type: ignore[union-attr]
                out.setdefault(delta.rid, []).append(delta)
    for r in reqs:
        final = oracle(qwen_tokenizer, r["ids"], True)
        expected, stop = stop_oracle(final, r["params"].stop, False)
        assert "".join(d.text for d in out[r["rid"]]) == expected, r
        assert out[r["rid"]][-1].finish == (Finish.STOP if stop else Finish.LENGTH)
    stopped = {r["rid"]: r["decode"] for r in reqs if out[r["rid"]][-1].stop_reason == " stop"}
    assert notified and all(stopped[rid] == j for j, rid in notified)
    assert all(s.num_active == 0 for s in shards)
    mean = sum(load.values()) / K
    assert all(abs(v - mean) <= 0.25 * mean for v in load.values()), load
    assert np.isfinite(mean)


def test_a_dead_owner_passes_its_requests_to_the_next_live_shard() -> None:
    from detokenizer.routing import live_shard_for

    rid = next(r for r in range(100) if shard_for(r, 3) == 1)
    assert live_shard_for(rid, [True, True, True]) == 1
    assert live_shard_for(rid, [True, False, True]) == 2
    assert live_shard_for(rid, [True, False, False]) == 0
    assert live_shard_for(rid, [False, False, False]) is None
