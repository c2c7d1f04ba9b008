"""KV reads in flight: a decode scheduler whose receiver copies over a network posts the
read and polls it from ``admit``, stepping its running requests meanwhile.

A receiver over the shm backend stands for the network: each read it starts lands (the
copy is made) only when the test says, or fails, or cannot be cancelled. Outputs must
equal those of the same requests with reads that land at once; a failed read ends its
request with a ``LOST`` row (the frontend resumes it) and gives its blocks back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch

from decode.scheduler import DecodeScheduler
from engine.build import build_engine
from engine.config import EngineConfig
from prefill.scheduler import PrefillScheduler
from tests.pipeline.drive import pair, run
from transport.errors import KVReadFailed
from transport.kv import KVRead
from transport.kv_backends import ShmReceiver
from wire.params import SamplingParams
from wire.records import Finish, GenerateRequest, KVRelease, TokenBatch

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class HeldRead(KVRead):
    """A read that lands when ``land`` is set, fails when ``fail`` is, and is still in
    flight (cannot be abandoned) while ``stuck``."""

    def __init__(self, rx: HeldReceiver, args: tuple[int, list[int], list[int]]) -> None:
        self.rx, self.args = rx, args
        self.land = self.fail = self.stuck = False

    def poll(self) -> bool:
        if self.fail:
            raise KVReadFailed("nixl READ from prefill 0 failed (ERR)")
        if self.land:
            ShmReceiver.fetch(self.rx, *self.args)
        return self.land

    def abandon(self) -> bool:
        return not self.stuck


class HeldReceiver(ShmReceiver):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.reads: dict[int, HeldRead] = {}  # by the first destination block

    def start_fetch(
        self, src_worker: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> KVRead | None:
        if src_worker not in self.sources:  # refused as the shm receiver refuses it
            return super().start_fetch(src_worker, src_blocks, dst_blocks)
        read = HeldRead(self, (src_worker, list(src_blocks), list(dst_blocks)))
        self.reads[len(self.reads)] = read
        return read


def _held_pair(model: Path) -> tuple[PrefillScheduler, DecodeScheduler, HeldReceiver]:
    p_engine = build_engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=128))
    d_engine = build_engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=128))
    receiver = HeldReceiver({0: p_engine.kv.tensor}, d_engine.kv.tensor)
    prefill = PrefillScheduler(p_engine, worker_index=0, chunk_budget=512)
    return prefill, DecodeScheduler(d_engine, receiver, max_num_seqs=8), receiver


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (37, 21)]


def _prefill(
    prefill: PrefillScheduler,
    decode: DecodeScheduler,
    prompts: list[list[int]],
    out: dict[int, list[int]],
) -> None:
    for rid, p in enumerate(prompts):
        prefill.add(
            GenerateRequest(rid=rid, prompt_ids=p, sampling=PARAMS, decode_worker=0, detok_shard=0)
        )
    step = prefill.step()
    for b in step.tokens.values():
        for rid, tok in zip(b.rids.tolist(), b.token_ids.tolist(), strict=True):
            out.setdefault(rid, []).append(tok)
    for _, transfer in step.transfers:
        assert decode.offer(transfer) == []


def _rows(batches: dict[int, TokenBatch]) -> list[tuple[int, int, int]]:
    """(rid, token, finish) of every row."""
    return [
        (rid, tok, fin)
        for b in batches.values()
        for rid, tok, fin in zip(
            b.rids.tolist(), b.token_ids.tolist(), b.finish.tolist(), strict=True
        )
    ]


def test_running_requests_step_while_a_read_is_in_flight_and_outputs_are_unchanged(
    default_model_path: Path,
) -> None:
    prompts = _prompts()
    ref_p, ref_d = pair(default_model_path)
    for rid, p in enumerate(prompts):
        ref_p.add(
            GenerateRequest(rid=rid, prompt_ids=p, sampling=PARAMS, decode_worker=0, detok_shard=0)
        )
    want = {rid: toks for rid, (toks, _) in run(ref_p, ref_d).items()}

    prefill, decode, rx = _held_pair(default_model_path)
    out: dict[int, list[int]] = {}
    _prefill(prefill, decode, prompts, out)
    assert decode.admit() == [] and set(decode.admission.reading) == {0, 1}
    rx.reads[0].land = True  # request 0's KV lands; request 1's is still on its way
    assert decode.admit() == [(0, KVRelease(rid=0, accepted=True))]
    prefill.release(0)
    for _ in range(3):
        for rid, tok, _ in _rows(decode.step().tokens):
            out[rid].append(tok)
        assert decode.admit() == []
    assert set(decode.running) == {0} and set(decode.admission.reading) == {1}
    assert decode.num_waiting == 1
    rx.reads[1].land = True
    assert decode.admit() == [(0, KVRelease(rid=1, accepted=True))]
    prefill.release(1)
    while decode.running:
        for rid, tok, _ in _rows(decode.step().tokens):
            out[rid].append(tok)
    assert out == want
    assert prefill.runner.kv.allocator.num_pinned == 0
    decode.runner.kv.allocator.check_invariants()


def test_a_failed_read_ends_its_request_lost_and_gives_its_blocks_back(
    default_model_path: Path,
) -> None:
    prefill, decode, rx = _held_pair(default_model_path)
    free = decode.runner.kv.num_free_blocks
    _prefill(prefill, decode, _prompts()[:1], {})
    decode.admit()
    assert decode.runner.kv.num_free_blocks < free
    rx.reads[0].fail = True
    assert decode.admit() == [(0, KVRelease(rid=0, accepted=False))]
    assert not decode.admission.reading and not decode.running
    assert decode.runner.kv.num_free_blocks == free
    # No token: the detokenizer passes the LOST row on and the frontend resumes it.
    assert _rows(decode.step().tokens) == [(0, -1, int(Finish.LOST))]
    assert _rows(decode.step().tokens) == []


def test_an_aborted_read_frees_its_blocks_only_once_nothing_can_write_them(
    default_model_path: Path,
) -> None:
    prefill, decode, rx = _held_pair(default_model_path)
    free = decode.runner.kv.num_free_blocks
    _prefill(prefill, decode, _prompts(), {})
    decode.admit()
    rx.reads[1].stuck = True  # still in flight: it may yet land
    held_by_1 = len(decode.admission.reading[1].seq.block_table)
    assert decode.abort(0) == [(0, KVRelease(rid=0, accepted=False))]
    assert decode.abort(1) == [(0, KVRelease(rid=1, accepted=False))]
    assert not decode.admission.reading and len(decode.admission.draining) == 1
    assert decode.runner.kv.num_free_blocks == free - held_by_1
    assert _rows(decode.step().tokens) == []  # aborted, not lost: nothing to report
    assert decode.admit() == [] and decode.admission.draining  # still in flight
    rx.reads[1].stuck = False  # it has ended
    assert decode.admit() == [] and not decode.admission.draining
    assert decode.runner.kv.num_free_blocks == free
    decode.runner.kv.allocator.check_invariants()


def test_a_refused_copy_fails_its_request_rather_than_resuming_it(
    default_model_path: Path,
) -> None:
    """A copy refused as asked (here: a source the receiver does not know) would be refused
    anywhere: the request ends with an error instead of being prefilled again."""
    prefill, decode, _ = _held_pair(default_model_path)
    free = decode.runner.kv.num_free_blocks
    prefill.add(
        GenerateRequest(
            rid=0, prompt_ids=_prompts()[0], sampling=PARAMS, decode_worker=0, detok_shard=0
        )
    )
    ((_, transfer),) = prefill.step().transfers
    unknown = msgspec.structs.replace(transfer, prefill_worker=5)
    assert decode.offer(unknown) == []
    assert decode.admit() == [(5, KVRelease(rid=0, accepted=False))]
    assert _rows(decode.step().tokens) == [(0, -1, int(Finish.ERROR))]
    assert decode.runner.kv.num_free_blocks == free
