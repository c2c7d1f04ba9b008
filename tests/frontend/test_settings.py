"""The frontend's launch record survives its trip through JSON, and refuses what it
does not know."""

from __future__ import annotations

import json

import pytest

from frontend.settings import ConnectionLimits, FrontendLaunch, FrontendSettings
from runtime.strict_spec import SpecError


def _launch() -> FrontendLaunch:
    http = FrontendSettings(
        model_name="m",
        max_model_len=2048,
        vocab_size=49152,
        model_aliases=("dir/m", "dir/m/"),
        allowed_hosts=("example.com",),
        eos_token_ids=(2, 7),
        tool_call_parser="hermes",
    )
    return FrontendLaunch(
        model="/ckpt",
        http=http,
        connections=ConnectionLimits(),
        router_policy="cache-aware",
        max_waiting_requests=None,
        max_queued_prefill_tokens=4096,
        stall_timeout_s=20.0,
        node="a",
        remote_decode=(2, 3),
    )


def test_round_trip_through_json_is_exact() -> None:
    launch = _launch()
    assert FrontendLaunch.from_json(json.loads(json.dumps(launch.to_json()))) == launch


def test_an_unknown_key_fails_at_startup() -> None:
    doc = _launch().to_json()
    doc["http"]["served_model_name"] = "m"  # a spelling the record does not have
    with pytest.raises(SpecError, match="unknown field `served_model_name`"):
        FrontendLaunch.from_json(doc)


def test_a_missing_key_fails_at_startup() -> None:
    doc = _launch().to_json()
    del doc["connections"]["body_timeout_s"]  # no default is filled in on the way
    with pytest.raises(SpecError, match="missing field `body_timeout_s`"):
        FrontendLaunch.from_json(doc)
