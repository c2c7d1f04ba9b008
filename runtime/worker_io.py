"""Ring plumbing every engine worker shares: decode what arrives, send with back-pressure."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from transport.errors import PeerDead, RecordTooLarge, RingFull
from transport.ring import Ring
from wire.records import Control, Finish, TokenBatch, decode, encode

logger = logging.getLogger(__name__)

MAX_RECORDS_PER_DRAIN = 256
PUT_TIMEOUT_S = 5.0  # a consumer that has not made room in this long is stuck or dead
IDLE_WAIT_S = 0.4  # idle workers still publish a heartbeat this often (busy ones: step_beat)


def drain(ring: Ring) -> Iterator[Control | TokenBatch]:
    """Decode every record queued on ``ring`` now (bounded, so one ring cannot starve)."""
    for raw in ring.drain(MAX_RECORDS_PER_DRAIN):
        yield decode(raw)


def send(ring: Ring, msg: Control | TokenBatch) -> bool:
    """Put a record, blocking while the consumer catches up; False if it cannot be sent
    (the consumer is gone, or the record can never fit its ring).

    NOTE: a record is never dropped while its consumer lives: a full ring blocks this
    worker (back-pressure) rather than losing tokens.
    """
    data = encode(msg)
    try:
        ring.put(data, timeout=PUT_TIMEOUT_S)
        return True
    except RecordTooLarge as e:  # one request's record; the worker serves on
        logger.error("ring %s: %s", ring.spec.tag, e)
        return False
    except PeerDead:
        logger.warning("ring %s: consumer is dead; record dropped", ring.spec.tag)
        return False
    except RingFull:
        logger.error("ring %s: full for %.0f s; consumer stuck", ring.spec.tag, PUT_TIMEOUT_S)
        raise


def fail_request(
    tok_rings: Mapping[int, Ring], rid: int, shard: int, position: int, lost: bool = False
) -> None:
    """Tell the request's detokenizer shard (hence the client) that it ends in an error,
    or with ``lost`` that this engine lost it (its KV could not reach its decoder, which
    died): a LOST row, on which the frontend resumes it elsewhere
    (``frontend/engine_link/recovery.py``), as it would once it noticed the death.

    ``position`` is the output position the request would have produced next.
    """
    finish = Finish.LOST if lost else Finish.ERROR
    row = TokenBatch.build([rid], [position], [-1], finish=[finish])
    send(tok_rings[shard], row)
