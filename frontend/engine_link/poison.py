"""Poison requests: which worker deaths a request is blamed for, and when it is given up.

A worker death is blamed on the requests that had just been given to the dead worker: a
request is *fresh* on its workers until it has received more than one token since it was
placed there (the first token is prefill's; the next comes from its decode worker's first
step). A request that crashes its worker by what it carries does so as it enters (its
prefill, its KV admission, its first decode step, its grammar); after a resume it enters
again, from its prompt and the tokens it has, so a request that keeps killing workers is
fresh at every death after the first. A request that was running steadily when its worker
died (a random crash, an operator's SIGKILL, a neighbour's poison) is not blamed: it is
resumed under the recovery's overall limit only.

A request is resumed after at most ``max_retries`` blamed deaths; at the next one it is
ended with ``finish = ERROR``, as poison, and every death it was present at is *explained*:
the launcher does not count those towards a worker's crash loop.

Requests co-admitted with a poison request are fresh with it at its first death, and all
get a strike. So that they are not present at its next death too, a request on its last
chance (``strikes == max_retries``) is resumed only while no other last-chance request is
fresh on its workers (``Recovery``'s probation): they re-enter one at a time, each for as long as it
takes to receive a token from its new workers, and only the poison dies again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.roles import Role

# Tokens a request may receive from its workers and still be fresh on them (prefill's first).
FRESH_TOKENS = 1


@dataclass(frozen=True)
class Death:
    """A worker process the frontend saw die (or stall), as a request's loss names it."""

    role: Role | None  # None: a detokenizer shard
    index: int
    pid: int  # 0 when not known (the worker restarted before the frontend saw it dead)
    how: str  # "killed by SIGABRT", "stalled", ...

    @property
    def kind(self) -> str:
        return "detokenizer shard" if self.role is None else f"{self.role.value} worker"

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index}"


@dataclass
class Strikes:
    """One request's record of the deaths it was present at."""

    placed_tokens: int = 0  # tokens it had when it was last (re)placed
    blamed: list[Death] = field(default_factory=list)
    present: list[Death] = field(default_factory=list)  # blamed or not

    def fresh(self, tokens: int) -> bool:
        """Had it just been given to its workers, with ``tokens`` received so far?"""
        return tokens - self.placed_tokens <= FRESH_TOKENS


def record_death(strikes: Strikes, death: Death, tokens: int, max_retries: int) -> bool:
    """Count ``death`` against a request that has ``tokens``; True when it is poison now
    (blamed for more deaths than its ``max_retries`` resumes allow)."""
    strikes.present.append(death)
    if strikes.fresh(tokens):
        strikes.blamed.append(death)
    return len(strikes.blamed) > max_retries


def poison_message(strikes: Strikes) -> str:
    """What the client is told: which workers died under the request, in words."""
    blamed = strikes.blamed
    kinds = {d.kind for d in blamed}
    times = "twice" if len(blamed) == 2 else f"{len(blamed)} times"
    who = f"the {blamed[0].kind}" if len(kinds) == 1 else "its workers"
    last = blamed[-1]
    return (
        f"request ended: {who} died {times} while serving it "
        f"(last: {last.name}, {last.how}); it is not retried again"
    )


def explained_pids(strikes: Strikes) -> list[int]:
    """The pids of the deaths a poison request explains: every one it was present at."""
    return sorted({d.pid for d in strikes.present if d.pid > 0})


def last_chance(strikes: Strikes, max_retries: int) -> bool:
    """Would one more blamed death end the request? Only a request blamed before is on
    probation (with ``max_retries`` 0 a blamed request is ended, never resumed)."""
    return bool(strikes.blamed) and len(strikes.blamed) >= max_retries
