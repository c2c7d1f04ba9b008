"""Speculative decoding under test: an in-process engine with a proposer the test picks.

The tiny checkpoints' random weights never repeat themselves, so n-gram lookup finds
nothing to propose there; these proposers force drafts instead. ``Oracle`` knows each
prompt's output without speculation and drafts from it: all right (``accept``), all
wrong (``reject``), right for half of k then wrong (``mixed``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from colocated.llm import LLM, GenerationResult
from engine.config import EngineConfig, SpeculativeConfig
from engine.kv.sequence import Sequence
from engine.speculative.proposer import Proposer
from wire.params import SamplingParams


class Oracle(Proposer):
    def __init__(self, refs: dict[tuple[int, ...], list[int]], mode: str, vocab: int) -> None:
        self.refs, self.mode, self.vocab = refs, mode, vocab
        self.proposed = 0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            ref = self.refs.get(tuple(seq.prompt_ids), [])
            n = len(seq.output_ids)
            right = ref[n : n + k]
            wrong = [(t + 1 + j) % self.vocab for j, t in enumerate(right)]
            if self.mode == "accept":
                d = right
            elif self.mode == "reject":
                d = wrong
            else:
                half = max(1, k // 2)
                d = right[:half] + wrong[half:]
            # Past the reference's end: anything (here: a fixed token).
            d += [7] * (k - len(d)) if self.mode != "accept" else []
            self.proposed += len(d)
            out.append(d)
        return out

    def release(self, rid: int) -> None:
        pass


def engine(model: Path, k: int | None, blocks: int = 512, **kw: object) -> LLM:
    """A co-located engine (its decode half is the decode scheduler), speculating with k
    drafts at any batch size, or not at all (k None)."""
    speculative = (
        None
        if k is None
        else SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=256)
    )
    config = EngineConfig(
        model=str(model), dtype="float32", num_kv_blocks=blocks, speculative=speculative
    )
    return LLM(replace(config, **kw))  # type: ignore[arg-type]


def with_proposer(llm: LLM, proposer: Proposer) -> LLM:
    """``llm`` speculating with ``proposer``'s drafts, all of them verified (no cost gate)."""
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None
    speculator.proposer = proposer
    return ungated(llm)


def ungated(llm: LLM) -> LLM:
    """Every draft offered is verified: the cost-aware gate (engine/speculative/cost.py) would
    decide by this machine's timings, and these tests force drafts to check exactness."""
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None
    speculator.times = None
    return llm


def generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[GenerationResult]:
    return llm.generate(prompts, params)


def prompts(n: int = 20, length: int = 24) -> list[list[int]]:
    """Token prompts of the Qwen2 vocabulary: some repeat themselves (input-grounded)."""
    out = []
    for i in range(n):
        base = [(i * 131 + j * 17) % 5000 + 200 for j in range(length)]
        out.append(base + base[: length // 2] if i % 3 == 0 else base)
    return out
