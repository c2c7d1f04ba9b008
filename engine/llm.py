"""An in-process engine: one ``ModelRunner`` plus a small continuous-batching scheduler.

Each step runs (1) one decode forward over every running sequence whose prompt is
done, then (2) one prefill forward over waiting/partial prompts, up to
``chunked_prefill_size`` tokens. Sequences join as soon as blocks allow and leave as
soon as they finish. When decode runs out of blocks the most recently admitted running
sequence is preempted: its blocks are freed and it is re-prefilled (prompt + output so
far) later, which the seeded sampler makes invisible in its tokens.

Used by tests, benchmarks, and as the co-located (non-disaggregated) baseline.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import NoFreeBlocks, PromptTooLongError
from engine.runner import ModelRunner
from engine.sampler import SampleOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from transport.records import Finish

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish: Finish
    logprobs: list[float] | None  # per output token, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # top-N (id, logprob) per token


class LLM:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self._next_rid = 0

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results are in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        seqs = [self._admit(p, sp) for p, sp in zip(prompts, plist)]
        waiting: deque[Sequence] = deque(seqs)
        running: list[Sequence] = []
        while waiting or running:
            self._step(waiting, running)
        return [self._result(s) for s in seqs]

    def _admit(self, prompt: list[int], params: SamplingParams) -> Sequence:
        runner = self.runner
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
        if math.ceil(longest / runner.block_size) > runner.allocator.num_blocks:
            raise NoFreeBlocks(math.ceil(longest / runner.block_size), runner.allocator.num_blocks)
        self._next_rid += 1
        return Sequence(self._next_rid, list(prompt), sampling=params, block_size=runner.block_size)

    def _step(self, waiting: deque[Sequence], running: list[Sequence]) -> None:
        decoding = [s for s in running if s.output_ids and s.num_uncomputed_tokens == 1]
        decoding = self._reserve_decode_blocks(decoding, running, waiting)
        if decoding:
            self._finish_step(self.runner.decode(decoding), decoding, running)
        while waiting and len(running) < self.config.max_num_seqs:
            running.append(waiting.popleft())
        chunks = self._plan_prefill([s for s in running if s not in decoding])
        if not decoding and not chunks and running:
            # Partial prefills hold every block and none can grow: free the newest.
            victim = running.pop()
            logger.info("rid %d preempted: prefills deadlocked on KV blocks", victim.rid)
            self.runner.free_blocks(victim)
            waiting.appendleft(victim)
            return
        if chunks:
            logits = self.runner.prefill(chunks)
            done = [i for i, (s, _) in enumerate(chunks) if s.num_uncomputed_tokens == 0]
            if done:
                self._finish_step(logits[done], [chunks[i][0] for i in done], running)

    def _reserve_decode_blocks(
        self, decoding: list[Sequence], running: list[Sequence], waiting: deque[Sequence]
    ) -> list[Sequence]:
        """Give every decoding sequence room for one token, preempting the newest if needed."""
        ready: list[Sequence] = []
        for seq in decoding:
            while seq in running:
                try:
                    self.runner.ensure_blocks(seq, 1)
                    ready.append(seq)
                    break
                except NoFreeBlocks:
                    victim = running.pop()
                    logger.info("rid %d preempted: KV pool full", victim.rid)
                    self.runner.free_blocks(victim)
                    waiting.appendleft(victim)
                    if victim in ready:
                        ready.remove(victim)
        return ready

    def _plan_prefill(self, candidates: list[Sequence]) -> list[tuple[Sequence, int]]:
        budget = self.config.chunked_prefill_size
        chunks: list[tuple[Sequence, int]] = []
        for seq in candidates:
            # NOTE: no-op unless this is its first chunk. A resumed sequence may be left
            # with only its newest token to run: a one-token prefill, equal to a decode.
            self.runner.reuse_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                continue
            try:
                self.runner.ensure_blocks(seq, n)
            except NoFreeBlocks:
                break  # it waits for blocks; later ones must not overtake it
            chunks.append((seq, n))
            budget -= n
            if budget == 0:
                break
        return chunks

    def _finish_step(
        self, logits: torch.Tensor, seqs: list[Sequence], running: list[Sequence]
    ) -> None:
        out = self.runner.sample(logits, seqs)
        for i, seq in enumerate(seqs):
            self._record(seq, out, i)
            seq.finish = self.runner.check_stop(seq)
            if seq.finish is not Finish.NONE:
                self.runner.free_blocks(seq)
                running.remove(seq)

    @staticmethod
    def _record(seq: Sequence, out: SampleOutput, i: int) -> None:
        seq.append_token(int(out.token_ids[i]))
        n = seq.sampling.logprobs
        if n is None:
            return
        seq.logprobs.append(float(out.logprobs[i]))
        top = zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist())
        seq.top_logprobs.append([(int(t), float(lp)) for t, lp in top])

    @staticmethod
    def _result(seq: Sequence) -> GenerationResult:
        wants = seq.sampling.logprobs is not None
        return GenerationResult(
            prompt_ids=seq.prompt_ids,
            output_ids=list(seq.output_ids),
            finish=seq.finish,
            logprobs=list(seq.logprobs) if wants else None,
            top_logprobs=list(seq.top_logprobs) if wants else None,
        )
