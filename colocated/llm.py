"""``LLM``: the in-process API, run to completion over the co-located scheduler.

One ``ModelRunner`` and one ``ColocatedScheduler``: the same scheduling loop a
``launch --colocated`` worker runs, minus the rings. Prompts are validated up front, so
a request that can never run raises (``PromptTooLongError``, ``NoFreeBlocks``,
``ValueError``) instead of being queued. Used by tests and benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from colocated.scheduler import ColocatedScheduler
from engine.build import Engine, build_engine
from engine.config import EngineConfig
from engine.errors import NoFreeBlocks, PromptTooLongError
from wire.params import SamplingParams
from wire.records import Finish, GenerateRequest, TokenBatch


@dataclass(frozen=True)
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish: Finish
    logprobs: list[float] | None  # per output token, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # top-N (id, logprob) per token
    # Speculation: drafts verified for the request, and accepted drafts among output_ids.
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class _Output:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: Finish = Finish.NONE
    drafted: int = 0
    accepted: int = 0


def check_request(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    """Raise if ``prompt`` with ``params`` could never run on ``engine``."""
    runner = engine.runner
    params.validate(runner.model_config.vocab_size)
    if not prompt:
        raise ValueError("a prompt needs at least one token")
    if len(prompt) >= runner.max_model_len:
        raise PromptTooLongError(
            f"prompt of {len(prompt)} tokens leaves no room within max_model_len "
            f"{runner.max_model_len}"
        )
    # A sequence that can never fit in the whole pool would wait forever.
    longest = min(len(prompt) + params.max_tokens, runner.max_model_len)
    if math.ceil(longest / runner.block_size) > engine.kv.num_blocks:
        raise NoFreeBlocks(math.ceil(longest / runner.block_size), engine.kv.num_blocks)


class LLM:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = build_engine(config)
        self.runner, self.kv = self.engine.runner, self.engine.kv
        self.kv.defer_tier_stores = True
        self.scheduler = ColocatedScheduler(
            self.engine, 0, config.chunked_prefill_size, config.max_num_seqs
        )
        self._next_rid = 0

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results are in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for prompt, sp in zip(prompts, plist):
            check_request(self.engine, prompt, sp)
        outputs: dict[int, _Output] = {}
        for prompt, sp in zip(prompts, plist):
            self._next_rid += 1
            req = GenerateRequest(self._next_rid, list(prompt), sp, decode_worker=0, detok_shard=0)
            verdict = self.scheduler.add(req)
            assert verdict == Finish.NONE, "check_request() let through what cannot fit"
            outputs[req.rid] = _Output(sp)
        while self.scheduler.has_work:
            for _, batch in self.scheduler.step().tokens:
                _collect(batch, outputs)
            self.kv.store_offered()  # as a worker's loop does after a step
        return [_result(prompt, out) for prompt, out in zip(prompts, outputs.values(), strict=True)]


def _collect(batch: TokenBatch, outputs: dict[int, _Output]) -> None:
    rows = zip(
        batch.rids.tolist(),
        batch.token_ids.tolist(),
        batch.logprobs.tolist(),
        batch.finish.tolist(),
        _zeros_if_none(batch.drafted, batch.size),
        _zeros_if_none(batch.accepted, batch.size),
    )
    for i, (rid, token, logprob, finish, drafted, accepted) in enumerate(rows):
        out = outputs[rid]
        out.token_ids.append(token)
        out.finish = Finish(finish)
        out.drafted += drafted
        out.accepted += accepted
        n = out.params.logprobs
        if n is None:
            continue
        out.logprobs.append(logprob)
        ids, lps = batch.top_ids[i, :n].tolist(), batch.top_logprobs[i, :n].tolist()
        out.top_logprobs.append(list(zip(ids, lps)))


def _zeros_if_none(col: np.ndarray | None, n: int) -> list[int]:
    return [0] * n if col is None else col.tolist()


def _result(prompt: list[int], out: _Output) -> GenerationResult:
    wants = out.params.logprobs is not None
    return GenerationResult(
        prompt_ids=list(prompt),
        output_ids=out.token_ids,
        finish=out.finish,
        logprobs=out.logprobs if wants else None,
        top_logprobs=out.top_logprobs if wants else None,
        drafted_tokens=out.drafted,
        accepted_tokens=out.accepted,
    )
