"""Speculation at the edges: grammars, the prefix cache, the P->D handoff."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import torch

from decode.scheduler import DecodeScheduler
from engine.build import build_engine
from engine.config import EngineConfig, SpeculativeConfig
from engine.kv.sequence import Sequence
from engine.speculative.proposer import Proposer
from engine.speculative.speculator import Speculator
from tests.pipeline.drive import float_engine, pair_of, run
from tests.speculative.helpers import Oracle, engine, prompts, with_proposer
from wire.params import GrammarKind, GrammarSpec, SamplingParams
from wire.records import Finish, GenerateRequest

VOCAB = 151936
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


class Junk(Proposer):
    """Drafts a grammar mostly forbids: spaces, letters and braces in any order."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        pool = [220, 90, 64, 92, 1, 330, 515]  # ' ', '{', 'a', '}', '"', ' {', ' "'
        return [
            [pool[(len(s.output_ids) + j) % len(pool)] for j in range(k)] for s, k in zip(seqs, ks)
        ]

    def release(self, rid: int) -> None:
        pass


def test_grammar_outputs_are_valid_and_identical_with_forbidden_drafts(
    default_model_path: Path, qwen_tokenizer: Any
) -> None:
    """json_schema and a tool_choice=required-like (EBNF) grammar: drafts the grammar
    forbids are cut, the matcher advances by emitted tokens only."""
    spec_json = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(SCHEMA))
    spec_choice = GrammarSpec(kind=GrammarKind.CHOICE, text=json.dumps(["yes", "no way"]))
    ps = prompts(6, 12)
    params = [
        SamplingParams(
            max_tokens=60, temperature=1.0, seed=i, grammar=spec_json if i % 2 else spec_choice
        )
        for i in range(len(ps))
    ]
    want = engine(default_model_path, None).generate(ps, params)
    refs = {tuple(w.prompt_ids): w.output_ids for w in want}
    for proposer in (Junk(), Oracle(refs, "mixed", VOCAB), Oracle(refs, "accept", VOCAB)):
        llm = with_proposer(engine(default_model_path, 4), proposer)
        got = llm.generate(ps, params)
        assert [g.output_ids for g in got] == [w.output_ids for w in want]
        for i, g in enumerate(got):
            assert g.finish == Finish.STOP
            text = qwen_tokenizer.decode(g.output_ids, skip_special_tokens=True)
            if i % 2:
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert text in ("yes", "no way")


def test_the_prefix_cache_never_holds_rejected_kv(default_model_path: Path) -> None:
    """Every block the cache publishes after speculative steps holds the KV of the
    tokens its hash names: recomputed from scratch, it is the same."""
    ps = prompts(4, 40)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = engine(default_model_path, None).generate(ps, params)
    refs = {tuple(w.prompt_ids): w.output_ids for w in want}
    llm = with_proposer(engine(default_model_path, 6, blocks=256), Oracle(refs, "mixed", VOCAB))
    got = llm.generate(ps, params)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    runner = llm.runner
    by_hash = dict(runner.kv.allocator._by_hash)
    fresh = build_engine(
        EngineConfig(
            model=str(default_model_path),
            dtype="float32",
            num_kv_blocks=64,
            enable_prefix_caching=False,
        )
    ).runner
    checked = 0
    for g in got:
        tokens = g.prompt_ids + g.output_ids
        seq = Sequence(rid=1, prompt_ids=tokens, block_size=runner.block_size)
        hashes = seq.full_block_hashes((len(tokens) - 1) // runner.block_size)
        ref = Sequence(rid=2, prompt_ids=tokens, block_size=runner.block_size)
        fresh.prefill([(ref, len(tokens))])
        for i, h in enumerate(hashes):
            if h in by_hash:
                cached, expect = runner.kv.tensor[by_hash[h]], fresh.kv.tensor[ref.block_table[i]]
                torch.testing.assert_close(cached, expect, atol=1e-4, rtol=1e-4)
                checked += 1
        fresh.kv.free_blocks(ref)
    # Output blocks were published (decode-time ones included), and none is foreign.
    assert checked == len(by_hash) and checked > sum(len(p) // 16 for p in ps)


def test_speculation_from_the_first_decode_token_after_the_handoff(
    default_model_path: Path,
) -> None:
    """Prefill samples token 0 and hands off; decode speculates from its first step."""
    ps = prompts(8, 30)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=16, temperature=0.8, seed=9),
    ] * 4
    outs = []
    for k in (None, 4):
        engines = float_engine(default_model_path, 256), float_engine(default_model_path, 256)
        prefill, decode = pair_of(*engines)
        if k is not None:
            cfg = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=64)
            refs = {tuple(p): o for p, (o, _) in zip(ps, outs[0].values())}
            decode.speculator = Speculator(engines[1], cfg, Oracle(refs, "mixed", VOCAB))
            decode.speculator.times = None  # every draft verified (no cost gate)
        for rid, (p, sp) in enumerate(zip(ps, params)):
            req = GenerateRequest(
                rid=rid, prompt_ids=p, sampling=sp, decode_worker=0, detok_shard=0
            )
            assert prefill.add(req) == Finish.NONE
        outs.append(run(prefill, decode))
        assert isinstance(decode, DecodeScheduler)
    assert outs[1] == outs[0]
    assert decode.speculator is not None and decode.speculator.stats.num_accepted_tokens > 0
