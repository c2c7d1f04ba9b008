"""The frontend's grammar check (frontend/engine_link/grammar_pool.py), on the tiny model's
vocabulary: verdicts, the budget (a compile that outlasts it has its process killed and
replaced), and the cache of verdicts."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from bundled_models import tiny
from engine.sampling.grammar import GrammarError
from frontend.engine_link.grammar_pool import GrammarPool, GrammarTimeout, GrammarUnavailable
from frontend.engine_link.grammar_worker import WorkerConfig
from wire.params import GrammarKind, GrammarSpec

pytestmark = pytest.mark.anyio
BUDGET_S = 3.0


def schema(properties: int) -> GrammarSpec:
    """About 1.5 s of compiling per property (string length bounds), else small."""
    props = {
        f"p{i}": {"type": "string", "minLength": 1000 + i, "maxLength": 2000 + i}
        for i in range(properties)
    }
    return GrammarSpec(
        kind=GrammarKind.JSON_SCHEMA, text=json.dumps({"type": "object", "properties": props})
    )


async def test_verdicts_budget_and_cache() -> None:
    config = WorkerConfig(
        model_dir=str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH)), vocab_size=151936, stop_ids=[151645]
    )
    pool = GrammarPool(config, timeout_s=BUDGET_S, workers=1)
    try:
        pool.start()
        await pool.check(GrammarSpec(kind=GrammarKind.JSON_OBJECT))  # compiles: no error
        bad = GrammarSpec(kind=GrammarKind.REGEX, text="((")
        for _ in range(2):  # the second from the cache, as a fresh error
            with pytest.raises(GrammarError, match="invalid regex"):
                await pool.check(bad)
        assert (pool.compiles, pool.hits) == (2, 1)
        (worker,) = pool._workers
        with pytest.raises(GrammarTimeout, match=f"within {BUDGET_S:g} s"):
            await pool.check(schema(20))
        assert worker.proc.returncode is not None  # killed: nothing compiles behind it
        assert pool.abandoned == 1
        with pytest.raises(GrammarTimeout):  # cached: no second compile of it
            await pool.check(schema(20))
        assert pool.compiles == 3
        await pool.check(GrammarSpec(kind=GrammarKind.REGEX, text="a+"))  # a fresh worker
        assert worker not in pool._workers and len(pool._workers) == 1
    finally:
        await pool.close()
    assert all(w.proc.returncode is not None for w in pool._workers)


async def test_no_worker_before_the_first_grammar_and_one_for_it() -> None:
    """A worker holds ~200 MiB: none until a grammar comes, and the first grammar starts
    one, not one plus a spare for itself (workers=2)."""
    config = WorkerConfig(
        model_dir=str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH)), vocab_size=151936, stop_ids=[151645]
    )
    pool = GrammarPool(config, timeout_s=BUDGET_S, workers=2)
    try:
        assert not pool._workers and pool._live + pool._starting == 0
        await pool.check(GrammarSpec(kind=GrammarKind.JSON_OBJECT))
        assert pool._live + pool._starting == 1 and len(pool._workers) == 1
    finally:
        await pool.close()


async def test_a_worker_that_cannot_start_fails_the_waiting_request_with_its_reason(
    tmp_path: pathlib.Path,
) -> None:
    """No worker will come: the requests waiting (two at once, each with a start of its
    own) are answered at once (a server fault, with the worker's exit), not after the
    startup timeout; the next requests try fresh workers, and fail the same way."""
    config = WorkerConfig(model_dir=str(tmp_path / "missing"), vocab_size=8, stop_ids=[0])
    pool = GrammarPool(config, timeout_s=BUDGET_S, workers=2)
    specs = [
        GrammarSpec(kind=GrammarKind.JSON_OBJECT),
        GrammarSpec(kind=GrammarKind.REGEX, text="a+"),
    ]
    try:
        for _ in range(2):
            got = await asyncio.gather(*(pool.check(s) for s in specs), return_exceptions=True)
            for e in got:
                assert isinstance(e, GrammarUnavailable), e
                assert "failed to start: it exited with status" in str(e)
            assert not pool._workers and pool._starting == 0 and pool._live == 0
        assert pool.compiles == 0
    finally:
        await pool.close()
