"""The co-located scheduler: one runner prefills and decodes, KV adopted in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from colocated.scheduler import ColocatedScheduler, NoKVTransfers
from decode.scheduler import DecodeScheduler, DecodeStep
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.sampling.sampler import SampleOutput
from prefill.scheduler import SHARED_CHUNK, PrefillScheduler
from transport.errors import KVTransferError
from wire.params import SamplingParams
from wire.records import Finish, GenerateRequest, TokenBatch

torch.set_num_threads(1)


def _sched(model: Path, blocks: int = 256, max_num_seqs: int = 64) -> ColocatedScheduler:
    engine = build_engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=blocks))
    return ColocatedScheduler(engine, worker_index=0, chunk_budget=48, max_num_seqs=max_num_seqs)


def _req(rid: int, prompt: list[int], params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(
        rid=rid, prompt_ids=prompt, sampling=params, decode_worker=0, detok_shard=rid % 2
    )


def _run(sched: ColocatedScheduler) -> dict[int, list[int]]:
    """Step until idle; rid -> output ids by position (each position exactly once)."""
    outputs: dict[int, dict[int, int]] = {}
    finished: set[int] = set()
    for _ in range(10_000):
        for shard, batch in sched.step().tokens:
            for rid, pos, tok, fin in zip(
                batch.rids.tolist(),
                batch.positions.tolist(),
                batch.token_ids.tolist(),
                batch.finish.tolist(),
            ):
                assert shard == rid % 2 and pos not in outputs.get(rid, {})
                outputs.setdefault(rid, {})[pos] = tok
                if fin != Finish.NONE:
                    finished.add(rid)
        # Adopted requests cannot be refused, so admission must keep the batch bounded.
        assert sched.num_running + sched.prefill.num_waiting <= sched.max_num_seqs
        if not sched.has_work:
            break
    assert set(outputs) == finished
    return {rid: [toks[i] for i in range(len(toks))] for rid, toks in outputs.items()}


def _assert_all_free(sched: ColocatedScheduler) -> None:
    a = sched.runner.kv.allocator
    a.check_invariants()
    assert a.num_used == 0 and a.num_pinned == 0 and a.num_available == a.num_blocks


@pytest.mark.parametrize("mixed", [False, True], ids=["two-forwards", "mixed"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_colocated_greedy_matches_transformers_and_frees_blocks(arch: str, mixed: bool) -> None:
    from transformers import AutoModelForCausalLM

    from bundled_models.tiny import tiny_model_dir

    model = tiny_model_dir(arch)
    sched = _sched(model)
    sched.mixed = mixed
    g = torch.Generator().manual_seed(11)
    # 95 tokens span two 48-token prefill chunks while the others already decode.
    prompts = [torch.randint(0, 150_000, (n,), generator=g).tolist() for n in (1, 17, 40, 95)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for rid, prompt in enumerate(prompts):
        assert sched.add(_req(rid, prompt, params)) == Finish.NONE
    got = _run(sched)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for rid, prompt in enumerate(prompts):
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )
        assert got[rid] == want[0, len(prompt) :].tolist(), f"rid {rid}"
    _assert_all_free(sched)


def test_batch_bounded_by_max_num_seqs_and_preemption_keeps_output(
    default_model_path: Path,
) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [[200 + i] * 25 for i in range(6)]

    def run(blocks: int, max_num_seqs: int) -> dict[int, list[int]]:
        sched = _sched(default_model_path, blocks, max_num_seqs)
        for rid, prompt in enumerate(prompts):
            sched.add(_req(rid, prompt, params))
        out = _run(sched)
        _assert_all_free(sched)
        return out

    reference = run(blocks=256, max_num_seqs=64)
    assert run(blocks=256, max_num_seqs=2) == reference
    assert run(blocks=12, max_num_seqs=64) == reference  # too few blocks: preempts


def test_abort_frees_blocks_wherever_the_request_is(default_model_path: Path) -> None:
    sched = _sched(default_model_path, max_num_seqs=2)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    sched.add(_req(0, [5] * 20, params))  # decoding after one step
    sched.add(_req(1, [6] * 100, params))  # mid-prefill (48-token chunks)
    sched.add(_req(2, [7] * 20, params))  # still queued: max_num_seqs is 2
    sched.step()
    assert set(sched.decode.running) == {0} and sched.prefill.num_waiting == 1
    assert len(sched.queued) == 1
    for rid in range(3):
        sched.abort(rid)
    assert not sched.has_work
    _assert_all_free(sched)


def test_request_that_can_never_fit_is_rejected(default_model_path: Path) -> None:
    sched = _sched(default_model_path, blocks=4)
    params = SamplingParams(max_tokens=8)
    assert sched.add(_req(0, [1] * 200, params)) == Finish.ERROR
    assert not sched.has_work


def test_colocated_decode_half_refuses_kv_imports() -> None:
    with pytest.raises(KVTransferError):
        NoKVTransfers().fetch(0, [1], [2])


def test_prefill_keep_kv_hands_over_unpinned_and_decode_adopts(default_model_path: Path) -> None:
    engine = build_engine(
        EngineConfig(model=str(default_model_path), dtype="float32", num_kv_blocks=64)
    )
    runner = engine.runner
    prefill = PrefillScheduler(engine, worker_index=0, chunk_budget=64, keep_kv=True)
    decode = DecodeScheduler(engine, NoKVTransfers(), max_num_seqs=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill.add(_req(0, [9] * 33, params))
    out = prefill.step()
    assert out.transfers == [] and runner.kv.allocator.num_pinned == 0
    [(seq, shard)] = out.handovers
    assert shard == 0 and seq.num_computed_tokens == 33 and len(seq.output_ids) == 1
    decode.adopt(seq, shard)
    while decode.running:
        decode.step()
    assert len(seq.output_ids) == 4
    assert runner.kv.allocator.num_used == 0


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "two-forwards"])
def test_emit_takes_first_tokens_before_the_decode_tokens(
    default_model_path: Path, mixed: bool
) -> None:
    """With ``emit``, a new request's first token leaves before the running batch's decode
    tokens are sampled (unmixed: before its decode forward); the tokens, their order per
    shard and the outputs are those without it."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {0: [5] * 20, 1: [6] * 30, 2: [7] * 9}

    def run(with_emit: bool) -> list[tuple[int, list[int], list[int]]]:
        sched = _sched(default_model_path)
        sched.mixed = mixed
        order: list[str] = []
        decode_step, sample = sched.decode.step, sched.runner.sample

        def traced_decode(*forward: Callable[[list[Sequence]], torch.Tensor]) -> DecodeStep:
            if not mixed:
                order.append("decode")
            return decode_step(*forward)

        def traced_sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
            if mixed and any(s.rid in sched.decode.running for s in seqs):
                order.append("decode")
            return sample(logits, seqs)

        sched.decode.step = traced_decode  # type: ignore[method-assign]
        sched.runner.sample = traced_sample  # type: ignore[method-assign]
        sent: list[tuple[int, list[int], list[int]]] = []

        def emit(shard: int, batch: TokenBatch) -> None:
            order.append("emit")
            sent.append((shard, batch.rids.tolist(), batch.token_ids.tolist()))

        sched.add(_req(0, prompts[0], params))
        both = 0  # steps that emitted first tokens and ran a decode forward
        for step in range(40):
            if step == 2:  # arrive while request 0 decodes
                sched.add(_req(1, prompts[1], params))
                sched.add(_req(2, prompts[2], params))
            order.clear()
            out = sched.step(emit=emit if with_emit else None)
            sent += [(s, b.rids.tolist(), b.token_ids.tolist()) for s, b in out.tokens]
            # Within a step, every emit comes before the decode forward (or sampling).
            assert order == sorted(order, key=lambda event: event == "decode")
            both += "emit" in order and "decode" in order
            if not sched.has_work:
                break
        assert both > 0 if with_emit else both == 0
        _assert_all_free(sched)
        return sent

    assert run(with_emit=True) == run(with_emit=False)


def test_mixed_batches_run_chunks_and_decode_rows_in_one_forward(default_model_path: Path) -> None:
    """A step with prompt chunks to run and requests decoding makes one forward (the decode
    rows as chunks of one token), two with mixing off; greedy outputs agree either way
    here (the rows' kernels differ, so only to the last bits in general)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(mixed: bool) -> tuple[dict[int, list[int]], int, int]:
        sched = _sched(default_model_path)
        sched.mixed = mixed
        calls = {"prefill": 0, "decode": 0}
        both_steps = 0
        for name in calls:
            real = getattr(sched.runner, name)

            def traced(
                *args: object, _real: Callable[..., torch.Tensor] = real, _n: str = name
            ) -> torch.Tensor:
                calls[_n] += 1
                return _real(*args)

            setattr(sched.runner, name, traced)
        sched.add(_req(0, [9] * 30, params))
        outputs: dict[int, list[int]] = {}
        for step in range(40):
            if step == 2:
                sched.add(_req(1, [8] * 100, params))  # three 48-token chunks
            before = dict(calls)
            planned, decoding = bool(sched.prefill.waiting or sched.queued), sched.num_running
            for _, batch in sched.step().tokens:
                for rid, tok in zip(batch.rids.tolist(), batch.token_ids.tolist()):
                    outputs.setdefault(rid, []).append(tok)
            forwards = {k: calls[k] - before[k] for k in calls}
            if planned and decoding:
                both_steps += 1
                assert forwards == (
                    {"prefill": 1, "decode": 0} if mixed else {"prefill": 1, "decode": 1}
                )
            if not sched.has_work:
                break
        _assert_all_free(sched)
        return outputs, both_steps, calls["decode"]

    mixed, mixed_steps, _ = run(True)
    separate, separate_steps, _ = run(False)
    assert mixed_steps >= 3 and separate_steps >= 3
    assert mixed == separate and all(len(v) == 8 for v in mixed.values())


@pytest.mark.parametrize("others", [0, 1])
def test_a_cpu_worker_shared_by_requests_prefills_in_shorter_chunks(
    default_model_path: Path, others: int
) -> None:
    """A prompt alone in the worker goes in one chunk of the whole budget; with another
    request in (decoding, or queued beside it), in chunks of SHARED_CHUNK."""
    engine = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=512))
    sched = ColocatedScheduler(engine, worker_index=0, chunk_budget=2048, max_num_seqs=64)
    assert sched.shared_budget == SHARED_CHUNK
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for rid in range(others):
        sched.add(_req(rid, [5 + rid] * 4, params))
    while sched.num_running < others:
        sched.step()
    sched.add(_req(99, [7] * 1200, params))
    ran = sched.step().ran_prefill_tokens
    assert ran == (SHARED_CHUNK if others else 1200)
    while sched.prefill.waiting:  # the rest of the prompt in the chunks left, to its end
        sched.step()
    assert 99 in sched.decode.running


def test_prompts_that_arrive_together_are_prefilled_a_chunk_a_step(
    default_model_path: Path,
) -> None:
    """Two prompts queued at once, nothing decoding: the first step takes SHARED_CHUNK of
    them, not both; a budget below SHARED_CHUNK stays as it is."""
    engine = build_engine(EngineConfig(model=str(default_model_path), num_kv_blocks=256))
    small = ColocatedScheduler(engine, worker_index=0, chunk_budget=48, max_num_seqs=64)
    assert small.shared_budget == 48
    sched = ColocatedScheduler(engine, worker_index=0, chunk_budget=2048, max_num_seqs=8)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    sched.add(_req(0, [5] * SHARED_CHUNK, params))
    sched.add(_req(1, [6] * SHARED_CHUNK, params))
    assert sched.step().ran_prefill_tokens == SHARED_CHUNK
    assert sched.num_running == 1 and sched.prefill.num_waiting == 1
