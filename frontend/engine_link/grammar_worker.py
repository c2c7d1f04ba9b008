"""A grammar compile worker: one process that compiles grammars, one at a time, for a
frontend's ``GrammarPool`` (``frontend/engine_link/grammar_pool.py``).

Why a process: a grammar's compile cannot be interrupted from inside (xgrammar runs it
in C++), so the only way to abandon one that outlasts its budget is to kill whatever runs
it. The frontend kills this process and starts another; nothing keeps compiling behind
the 400 it answered.

    python -m frontend.engine_link.grammar_worker '{"model_dir": ..., "vocab_size": ...,
                                                   "stop_ids": [...]}'

Channel: length-prefixed frames (4 bytes big-endian, then msgspec JSON; never pickle) on
stdin (jobs ``{"id", "kind", "text"}``) and on the original stdout (replies ``{"id",
"ok", "error"}``; first a ``{"ready": true}`` once the compiler is loaded). Everything
else the process or its libraries print goes to stderr. It runs at a lower CPU
priority than serving (``NICENESS``): compiles yield the cores to requests in flight.
It exits when stdin closes, so a frontend that dies leaves no worker behind.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import sys
from typing import IO, Any

import msgspec

from engine.sampling.grammar import GrammarCache, GrammarError
from engine.tokenizer.hf_tokenizer import load_tokenizer
from runtime.process import PR_SET_PDEATHSIG, prctl
from wire.params import GrammarKind, GrammarSpec

logger = logging.getLogger(__name__)
HEADER = struct.Struct(">I")
# NOTE: below serving (0), so a compile yields the cores to requests in flight, but not
# the lowest: on a host loaded with other work a nice-19 compile starves past any budget.
NICENESS = 10


class Job(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    kind: GrammarKind
    text: str


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    model_dir: str
    vocab_size: int
    stop_ids: list[int]


def read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's payload, or None at the end of the stream."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    payload = stream.read(HEADER.unpack(head)[0])
    return payload if len(payload) == HEADER.unpack(head)[0] else None


def write_frame(stream: IO[bytes], obj: Any) -> None:
    payload = msgspec.json.encode(obj)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def serve(config: WorkerConfig, jobs: IO[bytes], replies: IO[bytes]) -> None:
    """Compile each job's grammar and reply whether it compiled, until ``jobs`` ends."""
    cache = GrammarCache(
        lambda: load_tokenizer(config.model_dir),
        config.vocab_size,
        config.stop_ids or None,
        model_dir=config.model_dir,
    )
    cache.compile_now(GrammarSpec(kind=GrammarKind.JSON_OBJECT))  # loads the vocabulary
    write_frame(replies, {"ready": True})
    while (payload := read_frame(jobs)) is not None:
        job = msgspec.json.decode(payload, type=Job)
        try:
            cache.compile_now(GrammarSpec(kind=job.kind, text=job.text))
            write_frame(replies, {"id": job.id, "ok": True, "error": None})
        except GrammarError as e:
            write_frame(replies, {"id": job.id, "ok": False, "error": str(e)})


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s grammar-worker %(levelname)s %(message)s",
    )
    os.nice(NICENESS)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    config = msgspec.json.decode(sys.argv[1].encode(), type=WorkerConfig)
    # Replies go to the stdout we were given; fd 1 becomes stderr, so that no library's
    # print can corrupt a frame.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        from setproctitle import setproctitle

        setproctitle("pdserve:grammar")
    except ImportError:  # pragma: no cover - a declared dependency
        pass
    serve(config, sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
