"""Per-request placement among ``launch --workers`` workers: hand off, or prefill where
it will decode.

While some workers prefill and others decode (``router/planner.py``), a request goes to
a PREFILL worker, whose KV then moves to a DECODE worker. That handoff is worth its copy
and its ring hop when the prefill would stall the decoder's running batch for long.
It is not when the decoder can compute the prompt about as fast as it takes the first
token to come back from a handoff, so the router places a request whole on the decode
worker (no handoff: it prefills there and decodes there) when that finishes it sooner:
    a short prompt to compute there: at most ``LOCAL_PROMPT_TOKENS`` once the prefix the
        decoder probably holds is reused (a short prompt, or a conversation's next turn
        on the worker that holds its history)
    or prefill queues longer than the handoff saves, while the decoder runs no request:
        the PREFILL worker's queued prompt tokens exceed the decoder's by more than the
        prompt itself plus ``LOCAL_QUEUE_MARGIN`` tokens (a burst of long prompts behind
        which a short one would wait). Not beside running requests: the prompt would
        stall each of their decode steps for its whole length, the TPOT the split is
        there to protect (chat at 2 req/s: ``--workers 2`` split this way showed TPOT
        p50 63 ms against the fixed 1P1D's 35 ms, benchmarks/results/goodput_run1.md)
Either way the tokens are the same (a request's tokens do not depend on where its
prefill ran); the choice is counted per request in /metrics (``pdserve_placements``).
"""

from __future__ import annotations

# A prompt this short costs a decoder about one decode step's time to prefill on a
# 2-core CPU (SmolLM2-135M: ~15 ms for 32 tokens, against 20-50 ms a step at 8-32 rows).
LOCAL_PROMPT_TOKENS = 32
# The queue gap past the prompt's own length at which waiting for prefill costs more
# than prefilling beside the decode batch (about half a second of CPU prefill).
LOCAL_QUEUE_MARGIN = 1024


def local_is_sooner(
    compute_tokens: int, queued_prefill: int, queued_decoder: int, decoder_running: int
) -> bool:
    """Should a request whose prompt costs ``compute_tokens`` on the decoder be prefilled
    there, given the prompt tokens queued on the prefill worker and on the decoder and
    the requests the decoder runs?"""
    if compute_tokens <= LOCAL_PROMPT_TOKENS:
        return True
    if decoder_running > 0:
        return False
    return queued_prefill - queued_decoder > compute_tokens + LOCAL_QUEUE_MARGIN
