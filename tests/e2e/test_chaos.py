"""A short chaos run (``python -m benchmarks.serving.chaos`` bounded to 20 s): random prefill,
decode and detokenizer SIGKILLs every 4 s under 12 streaming clients; every answer equals
its prompt's solo run, none is refused or ended with an error, and the tree is whole again
within the launcher's back-off cap."""

from __future__ import annotations

import shlex

from benchmarks.serving.chaos import LAUNCH_ARGS, ChaosConfig, chaos
from tests.conftest import LaunchedServer


def test_random_worker_kills_under_load_lose_no_request_and_refuse_none() -> None:
    srv = LaunchedServer(shlex.split(LAUNCH_ARGS))
    srv.wait_ready()
    try:
        cfg = ChaosConfig(srv.url, srv.proc.pid, duration_s=20, interval_s=4, clients=12)
        res = chaos(cfg)
    finally:
        srv.stop()
    events = [
        line for line in srv.log if "exited" in line or "killed" in line or "back-off" in line
    ]
    assert sum(res.kills.values()) >= 3, res.kills
    assert res.mismatches == [], res.mismatches[:3]
    assert set(res.outcomes) == {"exact"}, (res.outcomes, events[-20:])
    assert res.whole_after_s is not None, events[-20:]
