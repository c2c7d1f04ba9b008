"""A worker's settings are one typed record, decoded strictly: a field the worker does not
know, or one it lacks, stops it at startup with the field named, and the launcher reports
it without restarting it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from launcher.supervisor import Child, ChildFailed, Supervisor
from launcher.topology import Topology
from runtime.strict_spec import EXIT_BAD_SPEC, DetokWorkerSpec, SpecError, decode_spec, encode_spec
from runtime.worker_spec import EngineWorkerSpec
from transport.load_table import WorkerState
from wire.roles import Role


def _settings(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    engine = EngineConfig(model=str(tmp_path / "model"), block_size=32)
    return encode_spec(EngineWorkerSpec("error", engine, "shm"))


def test_a_spec_round_trips_with_every_field(tmp_path: Path) -> None:
    raw = _settings(tmp_path)
    assert "seed" in raw["engine"]  # defaults travel too: nothing is filled in silently
    spec = decode_spec(raw, EngineWorkerSpec)
    assert spec.engine.block_size == 32 and spec.kv_transfer == "shm"
    assert decode_spec(encode_spec(DetokWorkerSpec("info", "m")), DetokWorkerSpec).model == "m"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s.update(colour="blue"), "unknown field `colour`"),
        (lambda s: s["engine"].update(block_sise=16), "unknown field `block_sise`"),
        (lambda s: s.pop("kv_transfer"), "missing field `kv_transfer`"),
        (lambda s: s["engine"].pop("max_num_seqs"), "missing field `max_num_seqs`"),
        (lambda s: s["engine"].update(block_size="16"), "`$.engine.block_size`"),
        (lambda s: s.update(kv_transfer="tcp"), "`$.kv_transfer`"),
    ],
)
def test_a_wrong_field_is_named(tmp_path: Path, change, named: str) -> None:  # type: ignore[no-untyped-def]
    raw = _settings(tmp_path)
    change(raw)
    with pytest.raises(SpecError) as e:
        decode_spec(raw, EngineWorkerSpec)
    assert named in str(e.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s["engine"].update(kv_cache_gb=4), "unknown field `kv_cache_gb`"),
        (lambda s: s["engine"].pop("model"), "missing field `model`"),
    ],
)
def test_a_worker_refuses_a_bad_spec_at_startup_and_is_not_restarted(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    change,
    named: str,  # type: ignore[no-untyped-def]
) -> None:
    raw = _settings(tmp_path)
    change(raw)
    topo = Topology(0, 1, 1)
    child = Child(topo.spec(Role.DECODE, 0, raw), {})
    sup = Supervisor([child], topo.load_table(), 0)
    sup.start_all()
    try:
        with pytest.raises(ChildFailed, match=r"every decode worker failed.*refused its spec"):
            for _ in range(240):  # one interpreter start
                sup._tend(0.5)
        assert child.restarts == 0
        (row,) = [r for r in topo.load_table().snapshot() if r.role is Role.DECODE]
        assert row.state is WorkerState.FAILED and row.exit_status == EXIT_BAD_SPEC
    finally:
        sup.shutdown()
    err = capfd.readouterr().err
    assert "refusing my spec" in err and named in err, err[-2000:]


def test_an_optional_record_in_the_spec_is_checked_strictly_when_present() -> None:
    for speculative in (None, SpeculativeConfig(num_speculative_tokens=3)):
        s = EngineWorkerSpec("INFO", EngineConfig(model="m", speculative=speculative), "shm")
        assert decode_spec(encode_spec(s), EngineWorkerSpec) == s
    raw = encode_spec(
        EngineWorkerSpec("INFO", EngineConfig(model="m", speculative=speculative), "shm")
    )
    raw["engine"]["speculative"]["k"] = 4
    with pytest.raises(SpecError, match=r"unknown field `k` at `settings\.engine\.speculative\.k`"):
        decode_spec(raw, EngineWorkerSpec)
