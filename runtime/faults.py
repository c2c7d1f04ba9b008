"""A test-only fault: a request that crashes the worker serving it, every time.

Off unless ``PDSERVE_TEST_CRASH_TOKEN`` is in a worker's environment when it starts (only
tests set it, for the launch they start): ``ROLE:TOKEN[,ROLE:TOKEN...]`` with ROLE
``prefill`` (also read by co-located workers) or ``decode``. A worker of that role that
takes a request whose prompt holds token id TOKEN aborts on the spot (SIGABRT, as a crash
in native code would), before anything else happens to the request: the poison requests
of ``frontend/engine_link/poison.py``, on real processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from wire.roles import Role

logger = logging.getLogger(__name__)

CRASH_TOKEN_ENV = "PDSERVE_TEST_CRASH_TOKEN"


def crash_token(role: Role) -> int | None:
    """The token id whose requests crash a worker of ``role``; None (the default): none.
    A malformed value is an error at startup: a test that sets it wants it to work."""
    value = os.environ.get(CRASH_TOKEN_ENV)
    if not value:
        return None
    want = Role.PREFILL if role is Role.COLOCATED else role
    for item in value.split(","):
        name, sep, token = item.partition(":")
        if not sep or not token.strip().isdigit() or name.strip() not in ("prefill", "decode"):
            raise ValueError(f"{CRASH_TOKEN_ENV}={value!r}: want ROLE:TOKEN[,ROLE:TOKEN...]")
        if Role(name.strip()) is want:
            return int(token)
    return None


def crash_if_poisoned(token: int | None, prompt_ids: Sequence[int]) -> None:
    """Abort this process if ``prompt_ids`` hold the crash ``token`` (``crash_token``)."""
    if token is not None and token in prompt_ids:
        logger.error(
            "a request carries the test crash token %d (%s): aborting", token, CRASH_TOKEN_ENV
        )
        os.abort()
