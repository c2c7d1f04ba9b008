"""A short soak of the shared server: mixed load with hang-ups leaves nothing behind.

The CI variant of ``python -m benchmarks.serving.soak``: about 40 s of load on the session's
2P/2D/2K server, then every worker holds zero KV blocks and the launcher's process tree
holds no more shm segments, and no more than 10 % more shm bytes, fds or RSS, than after
the warm-up.
"""

from __future__ import annotations

import pytest

from benchmarks.serving.soak import BENIGN, Snapshot, SoakConfig, leaks, soak
from tests.conftest import LaunchedServer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")


def test_mixed_load_with_hangups_leaks_no_kv_shm_fds_or_memory(server: LaunchedServer) -> None:
    cfg = SoakConfig(
        url=server.url,
        duration_s=25,
        warmup_s=12,
        concurrency=8,
        seed=7,
        disconnect_p=0.25,
        abort_p=0.2,
    )
    res = soak(cfg, server.proc.pid)

    assert res.leaks == [], res.leaks
    assert res.errors == {}, res.outcomes
    # nothing died or was left over: launcher, 2 prefill, 2 decode, 2 shards, the frontend,
    # and the grammar-compile workers earlier tests' constrained requests started (none to
    # --grammar-workers 2; frontend/engine_link/grammar_pool.py)
    assert res.after.processes == res.before.processes
    assert 8 <= res.before.processes <= 8 + 2
    assert res.outcomes.get("ok", 0) >= 10
    assert res.outcomes.get("disconnected", 0) + res.outcomes.get("aborted", 0) >= 2
    seen = {key.split()[0] for key in res.by_endpoint}
    assert seen == set(ENDPOINTS)
    assert {key.split()[1] for key in res.by_endpoint} == {"stream=True", "stream=False"}
    assert set(res.outcomes) <= BENIGN


def _snap(**changes: object) -> Snapshot:
    base = {
        "kv_used": {"decode-0": 0},
        "shm_entries": 0,
        "shm_segments": 10,
        "shm_segment_bytes": 1000,
        "shm_used_bytes": 5000,
        "fds": 100,
        "rss_bytes": 10_000,
        "processes": 3,
    }
    return Snapshot(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("after", "culprit"),
    [
        ({"kv_used": {"decode-0": 2}}, "decode-0 holds 2 KV blocks"),
        ({"shm_segments": 11}, "shm segments"),
        ({"fds": 111}, "fds grew"),
        ({"rss_bytes": 11_001}, "rss_bytes grew"),
        ({"shm_segment_bytes": 1101}, "shm_segment"),
    ],
)
def test_leak_check_names_what_grew(after: dict[str, object], culprit: str) -> None:
    found = leaks(_snap(), _snap(**after))
    assert len(found) == 1 and culprit in found[0]


def test_leak_check_tolerates_ten_percent_and_ignores_machine_wide_shm() -> None:
    assert leaks(_snap(), _snap(fds=110, rss_bytes=11_000, shm_used_bytes=50_000)) == []
