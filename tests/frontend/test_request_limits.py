"""Size caps on request fields: whatever a body asks for fits the rings it must cross.

Found by the HTTP fuzz tests against the launched server: 16 stop strings of 30,000
characters made a detokenizer registration larger than its control ring (a 500), and
1.1 million stop_token_ids made a KV handoff record larger than its ring, which killed
the prefill worker that tried to send it.
"""

from __future__ import annotations

from typing import Any

import pytest

from frontend.api.common.protocol import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    CompletionRequest,
    parse_body,
    to_engine_params,
)
from frontend.errors import InvalidRequest
from launcher.topology import SMALL_RING_BYTES
from transport.ring import footprint
from wire.params import DetokParams, SamplingParams
from wire.records import DetokRegister, GenerateRequest, encode

VOCAB = 151_936
MAX_MODEL_LEN = 4096


def params(**fields: Any) -> tuple[SamplingParams, DetokParams]:
    body = parse_body(CompletionRequest, {"prompt": "hi", **fields})
    return to_engine_params(body, 8, None, VOCAB, 20)


def test_stop_strings_longer_than_the_cap_are_a_400() -> None:
    params(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(InvalidRequest, match="at most") as info:
        params(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
    assert (info.value.status, info.value.param) == (400, "stop")


def test_more_stop_token_ids_than_the_cap_are_a_400() -> None:
    params(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    with pytest.raises(InvalidRequest, match="at most") as info:
        params(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    assert (info.value.status, info.value.param) == (400, "stop_token_ids")


def test_the_largest_accepted_request_fits_the_smallest_ring() -> None:
    # 4-byte UTF-8 characters and 3-byte msgpack ids: the worst case per character/id.
    sampling, detok = params(
        stop=["\U0010ffff" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=[VOCAB - 1] * MAX_STOP_TOKEN_IDS,
        logprobs=20,
        seed=-(2**63),
    )
    register = DetokRegister(
        rid=2**63 - 1,
        params=detok,
        prompt_len=MAX_MODEL_LEN,
        num_logprobs=20,
        output_ids=[VOCAB - 1] * MAX_MODEL_LEN,
    )
    gen = GenerateRequest(
        rid=2**63 - 1,
        prompt_ids=[VOCAB - 1] * MAX_MODEL_LEN,
        sampling=sampling,
        decode_worker=0,
        detok_shard=0,
    )
    for record in (register, gen):
        assert footprint(len(encode(record))) <= SMALL_RING_BYTES // 2
