"""Grammar-constrained requests across the P->D handoff, in one process.

The tiny model's weights are random, so any output that parses is the grammar's doing:
the first token (sampled by prefill) and every decode token are masked, the decode
worker rebuilds the matcher from the handoff's tokens, and a request resumed with the
tokens it had produced (recovery) continues inside the grammar.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from decode.scheduler import DecodeScheduler
from prefill.scheduler import PrefillScheduler
from tests.pipeline.drive import pair, run
from wire.params import GrammarKind, GrammarSpec, SamplingParams
from wire.records import Finish, GenerateRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["x"],
        },
    },
    "required": ["name", "tags", "point"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]


def _run(prefill: PrefillScheduler, decode: DecodeScheduler) -> dict[int, tuple[list[int], int]]:
    return run(prefill, decode, pause_s=0.001)  # leave the core to the grammar thread


def _req(
    rid: int,
    spec: GrammarSpec,
    seed: int,
    output_ids: list[int] | None = None,
    max_tokens: int = 60,
    prompt_of: int | None = None,
) -> GenerateRequest:
    """``prompt_of``: the rid whose prompt to use (a resumed request's is its original's)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, grammar=spec)
    prompt_rid = rid if prompt_of is None else prompt_of
    return GenerateRequest(
        rid=rid,
        prompt_ids=[9707, 11, 1879, 0, prompt_rid % 50 + 100],
        sampling=params,
        decode_worker=0,
        detok_shard=0,
        output_ids=output_ids or [],
    )


def _check(kind: GrammarKind, text: str) -> None:
    if kind is GrammarKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind is GrammarKind.REGEX:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


SPECS = [
    GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(SCHEMA)),
    GrammarSpec(kind=GrammarKind.REGEX, text=REGEX),
    GrammarSpec(kind=GrammarKind.CHOICE, text=json.dumps(CHOICES)),
]


def test_constrained_outputs_parse_across_the_handoff(
    default_model_path: Path, qwen_tokenizer: Any
) -> None:
    prefill, decode = pair(default_model_path)
    for rid in range(12):
        assert prefill.add(_req(rid, SPECS[rid % 3], seed=rid)) == Finish.NONE
    out = _run(prefill, decode)
    for rid, (ids, fin) in out.items():
        assert fin == Finish.STOP, (rid, qwen_tokenizer.decode(ids))
        _check(SPECS[rid % 3].kind, qwen_tokenizer.decode(ids, skip_special_tokens=True))
    assert prefill.runner.grammars.compiled == 3  # cached per worker, by spec
    assert decode.runner.grammars.compiled == 3


def test_a_resumed_request_continues_inside_its_grammar(
    default_model_path: Path, qwen_tokenizer: Any
) -> None:
    """Recovery re-prefills prompt + tokens so far: the matcher replays them first."""
    prefill, decode = pair(default_model_path)
    spec = SPECS[0]
    prefill.add(_req(0, spec, seed=5))
    ((ids, _),) = _run(prefill, decode).values()
    for cut in (1, len(ids) // 2, len(ids) - 2):
        prefill.add(_req(100 + cut, spec, seed=5, output_ids=ids[:cut], prompt_of=0))
    for rid, (more, fin) in _run(prefill, decode).items():
        cut = rid - 100
        assert fin == Finish.STOP
        # Seeded: the resumed request produces exactly what the original did.
        assert ids[:cut] + more == ids
        _check(spec.kind, qwen_tokenizer.decode(ids[:cut] + more, skip_special_tokens=True))


def test_a_grammar_that_does_not_compile_ends_with_an_error(default_model_path: Path) -> None:
    prefill, decode = pair(default_model_path)
    prefill.add(_req(0, GrammarSpec(kind=GrammarKind.REGEX, text="(unclosed"), seed=1))
    prefill.add(_req(1, SPECS[1], seed=1))
    out = _run(prefill, decode)
    assert out[0] == ([-1], Finish.ERROR)
    assert out[1][1] == Finish.STOP
    prefill.runner.kv.allocator.check_invariants()
    assert prefill.runner.kv.allocator.num_used == 0


@pytest.mark.parametrize("greedy", [True, False])
def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(
    default_model_path: Path, greedy: bool
) -> None:
    """A batch mixing both: the plain row samples exactly what it samples alone."""
    temp = 0.0 if greedy else 1.0
    plain = SamplingParams(max_tokens=12, temperature=temp, seed=3, ignore_eos=True)

    def run(with_grammar: bool) -> list[int]:
        prefill, decode = pair(default_model_path)
        prefill.add(
            GenerateRequest(
                rid=0, prompt_ids=[9707, 1879], sampling=plain, decode_worker=0, detok_shard=0
            )
        )
        if with_grammar:
            prefill.add(_req(1, SPECS[1], seed=4))
        return _run(prefill, decode)[0][0]

    assert run(True) == run(False)


def test_a_slow_compile_stalls_no_other_request(default_model_path: Path, monkeypatch: Any) -> None:
    """While one request's grammar compiles (here: 3 s), a plain request runs to its end;
    the constrained one waits for its grammar, then parses."""
    prefill, decode = pair(default_model_path)
    grammars = prefill.runner.grammars
    real = grammars.compile_now

    def slow(spec: GrammarSpec) -> Any:
        time.sleep(3.0)
        return real(spec)

    monkeypatch.setattr(grammars, "compile_now", slow)
    slow_spec = GrammarSpec(kind=GrammarKind.REGEX, text="[0-9]{4}")
    prefill.add(_req(0, slow_spec, seed=1))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill.add(
        GenerateRequest(
            rid=1, prompt_ids=[9707, 1879], sampling=plain, decode_worker=0, detok_shard=0
        )
    )
    finished_at: dict[int, float] = {}
    t0 = time.monotonic()
    while len(finished_at) < 2 and time.monotonic() - t0 < 60:
        time.sleep(0.001)
        out = prefill.step()
        batches = list(out.tokens.values())
        for _, transfer in out.transfers:
            decode.offer(transfer)
        for _, release in decode.admit():
            prefill.release(release.rid)
        batches += decode.step().tokens.values()
        for b in batches:
            for rid, fin in zip(b.rids.tolist(), b.finish.tolist()):
                if fin:
                    finished_at[rid] = time.monotonic() - t0
    assert finished_at[1] < 2.0 < finished_at[0]
