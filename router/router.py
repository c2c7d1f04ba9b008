"""The router: places each request on a (prefill, decode) pair from load-table snapshots.

The router runs in the frontend, single-threaded (the event loop): ``place`` picks a
(prefill, decode) pair for a new request, ``release`` is called once when it ends.

Load is measured in tokens:
  prefill i   queued_prefill_tokens (reported) + prompt tokens the router sent that the
              worker has not taken off its ring yet (cumulative sent - cumulative received;
              the ring is FIFO and every sent request is eventually received, so this is
              exact, not a time-window guess).
  decode j    KV tokens the worker's requests will need until they finish. The router's
              own books give that: prompt_len + max_tokens for each request it assigned to
              j and has not released (early finishes come back through ``release``). The
              table gives what j really holds: (total - free) * block_size, plus those
              reservations for the assignments j does not hold yet (counted as active -
              running - waiting; requests reach decode from several prefill workers in any
              order, so the newest assignments are taken to be the unheld ones). The cost
              is the larger of the two views, so KV the router does not know of (work from
              before a frontend restart) still counts.
A colocated worker's load is the sum of both.

Cache-aware placement (``PolicyName.CACHE_AWARE``): the frontend hashes the request's
tokens once (``block_hashes``, the function workers use, so the values agree across
processes) and passes them to ``place``. Each candidate's prefix summary
(``transport/prefix_summary.py``, written by the worker every step) says how many
leading blocks it probably holds; what is left is the request's ``new_tokens`` there:
prompt tokens to compute on a prefill worker, KV tokens to store (and copy) on a decode
worker. The policy weighs them against each worker's cost above. Summaries are a guess:
a wrong one misplaces a request, the worker's own allocator still decides what is reused.
With the host's KV tiers on (``router/tier_residency.py``), a prefill or co-located
worker on the tiers' node also holds, after its pool's prefix, the run of blocks the
tiers would load into it: a prefix in tier 2 or 3 is a hit for every worker of the host.
(Decode workers take handed-off KV from their pool only, so tiers do not lower theirs.)

``launch --workers``: every worker is a co-located row, and its role in the role table
(``transport/role_table.py``) says what it is sent (``_by_role``; ``router/roles.py``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from engine.kv.block_allocator import block_hashes
from router.ledger import Ledger, PeerBooks, WorkerKey
from router.lora_affinity import AdapterAffinity
from router.policy import Candidate, PolicyName, make_policy
from router.roles import local_is_sooner
from router.tier_residency import TierQuery, TierResidency
from transport.load_table import LoadRow, LoadTable, WorkerState
from transport.prefix_summary import PrefixSummary
from transport.role_table import RoleTable
from transport.segment import pid_alive
from wire.roles import Role


class NoCapacity(Exception):
    """No worker can take the request now; the frontend answers 503 + Retry-After."""

    def __init__(self, retry_after_s: float, reason: str) -> None:
        super().__init__(f"no capacity ({reason})")
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(frozen=True)
class RouterConfig:
    """Admission bounds are per worker; None disables one (not recommended in production)."""

    # A row whose heartbeat is older than this is not routable. Workers publish once per step,
    # and one CPU step of a larger model (a long prefill chunk, a loaded machine) can take
    # seconds: a second thread beats while a step runs (runtime/step_beat.py). The launcher
    # sets it to the bound after which /health reports the worker stalled.
    stale_after_s: float = 5.0
    max_waiting_requests: int | None = 1024
    max_queued_prefill_tokens: int | None = 262_144
    retry_after_s: float = 1.0  # when workers are busy
    retry_after_dead_s: float = 5.0  # when no worker of a role is alive (a restart takes a while)
    seed: int | None = None  # power-of-two sampling; None draws from the OS
    max_loras: int = 1  # adapters a worker keeps resident (--max-loras): the affinity's bound


@dataclass(frozen=True)
class Placement:
    """Where a request runs: role indices (as carried in request records), not table slots."""

    prefill: int
    decode: int
    ticket: int = 0
    prompt_len: int = 0
    max_tokens: int = 0
    prefill_generation: int = 0
    decode_generation: int = 0
    colocated: bool = False  # one co-located worker runs both halves (prefill == decode)

    @property
    def keys(self) -> tuple[WorkerKey, WorkerKey]:
        """The ledger keys of the (prefill, decode) workers."""
        if self.colocated:
            return (Role.COLOCATED, self.prefill), (Role.COLOCATED, self.decode)
        return (Role.PREFILL, self.prefill), (Role.DECODE, self.decode)


class Router:
    def __init__(
        self,
        table: LoadTable,
        policy: PolicyName | str = PolicyName.LEAST_LOAD,
        config: RouterConfig | None = None,
        summaries: Mapping[WorkerKey, PrefixSummary] | None = None,
        peers: PeerBooks | None = None,
        tiers: TierResidency | None = None,
        roles: RoleTable | None = None,
        owner: int = 0,
    ) -> None:
        """``peers``: the other frontends' books (``router/ledger.py``), when several
        frontends route over the same workers; admission bounds then hold for their sum.
        ``tiers``: the host's KV tiers, a hit for every worker on ``tiers.node``.
        ``roles``: the roles of ``launch --workers`` workers (``transport/role_table.py``):
        placement follows them, and this frontend (``owner``) counts its placements there."""
        self.roles, self._owner = roles, owner
        self._table = table
        self._config = config or RouterConfig()
        # Prefix summaries by (role, index); read only by the cache-aware policy.
        self._summaries = dict(summaries or {})
        self._tiers = tiers
        self.cache_aware = PolicyName(policy) is PolicyName.CACHE_AWARE
        self._block_size = 0  # the workers' KV block size, learnt from the table
        seed = self._config.seed
        self._prefill_policy = make_policy(policy, seed)
        self._decode_policy = make_policy(policy, None if seed is None else ~seed, decode=True)
        self.ledger = Ledger(peers)
        self._tickets = itertools.count(1)
        # Where each LoRA adapter was sent lately (bounded like a worker's resident set).
        self.adapters = AdapterAffinity(self._config.max_loras)

    def hash_blocks(self, token_ids: Sequence[int], extra: bytes | None = None) -> list[int]:
        """The block hashes ``place`` wants for a request of ``token_ids``; [] (and no
        hashing cost) unless the policy is cache-aware. ``extra``: the salt the workers'
        hashes have (a LoRA adapter's, ``LoraRef.salt``). With host tiers, the list also
        carries the request's ``TierQuery`` (``PromptBlocks``)."""
        if not self.cache_aware or not (self._summaries or self._tiers):
            return []
        if not self._block_size:
            self._snapshot()
        if not self._block_size:
            return []
        hashes = PromptBlocks(block_hashes(token_ids, self._block_size, extra))
        if self._tiers is not None:
            hashes.tiers = self._tiers.query(token_ids, self._block_size, extra)
        return hashes

    def place(
        self,
        prompt_len: int,
        max_tokens: int,
        hashes: Sequence[int] = (),
        *,
        prefill: int | None = None,
        lora: str | None = None,
    ) -> Placement:
        """Choose the workers for a request, or raise ``NoCapacity``.

        ``hashes``: ``hash_blocks`` of the tokens prefill will compute (the prompt, plus
        the output so far for a resumed request); only cache-aware routing reads them.
        The placement is counted as in flight until ``release``; the caller must send it
        to the chosen prefill worker (or call ``release(p, delivered=False)``).
        ``prefill``: only that prefill (or co-located) worker will do, e.g. the one the
        other choices of an ``n > 1`` request went to, which shares their prompt's KV.
        ``lora``: the fingerprint of the request's LoRA adapter: workers that were sent it
        lately (and so probably hold it) are preferred at a similar load.
        """
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(
                f"prompt_len and max_tokens must be >= 1, got {prompt_len}, {max_tokens}"
            )
        rows, now = self._snapshot()
        req = _Request(prompt_len, max_tokens, hashes if self.cache_aware else (), lora)
        if self.roles is not None:
            p_row, d_row, kind = self._by_role(rows, req, now, prefill)
        else:
            p_role, d_role = _roles(rows)
            p_row = self._choose(rows, p_role, req, now, only=prefill)
            d_row = p_row if p_role is d_role else self._choose(rows, d_role, req, now)
        placement = self._commit(p_row, d_row, prompt_len, max_tokens)
        if self.roles is not None:
            self.roles.count(self._owner, kind)
        if lora is not None:
            for key in placement.keys:
                self.adapters.sent(key, lora)
        return placement

    def check_capacity(self) -> None:
        """Raise ``NoCapacity`` when ``place`` would refuse every request, however small.

        Cheap and commits nothing: the frontend asks before it parses and tokenizes a
        body, so a request burst beyond the admission bound is refused at a fraction of
        the cost of a full placement. ``place`` still decides for the requests it lets by.
        (Admission only gets harder as the prompt grows, so a 1-token prompt is the test.)
        """
        rows, now = self._snapshot()
        if self.roles is not None:
            self._by_role(rows, _Request(1, 1), now, None)
            return
        for role in set(_roles(rows)):
            self._choose(rows, role, _Request(1, 1), now)

    def release(self, placement: Placement, delivered: bool = True) -> None:
        """The request ended (any reason). ``delivered=False``: it was never sent to prefill.

        Releases of a worker generation that has since restarted are ignored: the new
        generation's books never included them.
        """
        p_key, d_key = placement.keys
        decode = self.ledger.current(d_key, placement.decode_generation)
        if decode is not None:
            decode.reserved.pop(placement.ticket, None)
            self.ledger.publish(d_key)
        if delivered:
            return
        # Nobody worked on it: it was never sent, nor assigned, after all.
        prefill = self.ledger.current(p_key, placement.prefill_generation)
        if prefill is not None:
            prefill.sent_requests -= 1
            prefill.sent_tokens -= placement.prompt_len
        kv = placement.prompt_len + placement.max_tokens
        if p_key == d_key:
            self.ledger.count(p_key, -kv, -1)
        else:
            self.ledger.count(p_key, -placement.prompt_len, -1)
            self.ledger.count(d_key, -kv, -1)
        self.ledger.publish(p_key)
        self.ledger.publish(d_key)

    def assigned(self) -> dict[WorkerKey, tuple[int, int]]:
        """(requests, tokens) assigned per (role, index) since the router started; with
        peers, by every frontend since the server started."""
        peers = self.ledger.peers
        if peers is None:
            return {key: (a.requests, a.tokens) for key, a in self.ledger.assigned.items()}
        return {key: peers.assigned(b.slot) for key, b in self.ledger.books.items()}

    # -- internals ---------------------------------------------------------------------

    def _snapshot(self) -> tuple[list[LoadRow], int]:
        rows = self._table.snapshot()
        self.ledger.sync(rows)
        if not self._block_size:
            self._block_size = next((r.block_size for r in rows if r.block_size > 0), 0)
        return rows, time.monotonic_ns()

    def _choose(
        self,
        rows: list[LoadRow],
        role: Role,
        req: _Request,
        now_ns: int,
        only: int | None = None,
        among: Collection[int] | None = None,
        decode: bool = False,
    ) -> LoadRow:
        """``among``: only workers of these indices; ``decode``: choose as a decoder."""
        live = [
            r
            for r in rows
            if r.role is role
            and self._routable(r, now_ns)
            and (only is None or r.index == only)
            and (among is None or r.index in among)
        ]
        if not live:
            raise NoCapacity(self._config.retry_after_dead_s, f"no live {role} worker")
        admitted = [r for r in live if self._admits(r, req.prompt_len)]
        admitted.sort(key=attrgetter("index"))
        if not admitted:
            raise NoCapacity(self._config.retry_after_s, f"every {role} worker is full")
        assigned = self.ledger.assigned
        candidates = [
            Candidate(r.index, self._cost(r), assigned[r.worker].tokens, self._new_tokens(r, req))
            for r in admitted
        ]
        if req.lora is not None:
            candidates = self._adapter_holders(admitted, candidates, req.lora)
        decode = decode or role is Role.DECODE
        policy = self._decode_policy if decode else self._prefill_policy
        pick = policy.choose(candidates).index
        return next(r for r in admitted if r.index == pick)

    def _by_role(
        self, rows: list[LoadRow], req: _Request, now_ns: int, only: int | None
    ) -> tuple[LoadRow, LoadRow, str]:
        """(prefill row, decode row, placement kind) among ``--workers`` workers by their
        roles (``transport/role_table.py``): a COLOCATED worker takes a request whole; a
        PREFILL one hands it to a DECODE (or COLOCATED) worker, unless prefilling it on
        that decoder finishes it sooner (``router/roles.py``)."""
        assert self.roles is not None
        roles = self.roles.roles()
        takers = [i for i, r in enumerate(roles) if r is not Role.DECODE]
        if not any(r.index in takers and self._routable(r, now_ns) for r in rows):
            # Every worker taking new requests is down: the decoders take it whole.
            decoders = [i for i, r in enumerate(roles) if r is Role.DECODE]
            d_row = self._choose(rows, Role.COLOCATED, req, now_ns, only=only, among=decoders)
            return d_row, d_row, "local"
        p_row = self._choose(rows, Role.COLOCATED, req, now_ns, only=only, among=takers)
        if roles[p_row.index] is Role.COLOCATED:
            return p_row, p_row, "colocated"
        decoders = [i for i, r in enumerate(roles) if r is not Role.PREFILL]
        try:
            d_row = self._choose(rows, Role.COLOCATED, req, now_ns, among=decoders, decode=True)
        except NoCapacity:  # no decoder can take it now: its prefill worker decodes it too
            return p_row, p_row, "colocated"
        running = d_row.running_requests + d_row.waiting_requests
        running += self.ledger.of(d_row).unreported_requests(d_row)
        if only is None and local_is_sooner(
            self._compute_tokens(d_row, req), self._queued(p_row), self._queued(d_row), running
        ):
            return d_row, d_row, "local"
        return p_row, d_row, "handoff"

    def _queued(self, r: LoadRow) -> int:
        """Prompt tokens waiting for ``r``'s prefill, those still on its ring included."""
        return r.queued_prefill_tokens + self.ledger.of(r).unsent_tokens(r)

    def _compute_tokens(self, r: LoadRow, req: _Request) -> int:
        """Prompt tokens ``r`` would compute for ``req`` past the prefix it probably holds."""
        summary = self._summaries.get(r.worker)
        bs = max(r.block_size, 1)
        held = summary.count_prefix(req.hashes) if summary is not None and req.hashes else 0
        return req.prompt_len - min(held, (req.prompt_len - 1) // bs) * bs

    def _adapter_holders(
        self, rows: list[LoadRow], candidates: list[Candidate], lora: str
    ) -> list[Candidate]:
        """The candidates that probably hold adapter ``lora``, if one of them is about as
        loaded as the least loaded worker; else all of them."""
        holders = [c for r, c in zip(rows, candidates) if self.adapters.holds(r.worker, lora)]
        if not holders:
            return candidates
        least = min(c.cost for c in candidates)
        if min(c.cost for c in holders) > least + self.adapters.slack_tokens:
            return candidates
        return holders

    def _routable(self, r: LoadRow, now_ns: int) -> bool:
        if r.state is not WorkerState.READY or r.pid <= 0:
            return False
        if now_ns - r.heartbeat_ns > self._config.stale_after_s * 1e9:
            return False
        return pid_alive(r.pid)

    def _admits(self, r: LoadRow, prompt_len: int) -> bool:
        cfg, books = self._config, self.ledger.of(r)
        waiting = r.waiting_requests + books.unreported_requests(r)
        if cfg.max_waiting_requests is not None and waiting >= cfg.max_waiting_requests:
            return False
        if r.role is Role.DECODE or cfg.max_queued_prefill_tokens is None:
            return True
        queued = r.queued_prefill_tokens + books.unsent_tokens(r)
        # An idle worker takes any prompt, however long: the bound limits queues, not prompts.
        return queued == 0 or queued + prompt_len <= cfg.max_queued_prefill_tokens

    def _cost(self, r: LoadRow) -> int:
        books = self.ledger.of(r)
        prefill = r.queued_prefill_tokens + books.unsent_tokens(r)
        if r.role is Role.PREFILL:
            return prefill
        used = (r.total_kv_blocks - r.free_kv_blocks) * r.block_size
        decode = max(used + books.unheld_reserved(r), books.reserved_tokens)
        return decode if r.role is Role.DECODE else decode + prefill

    def _new_tokens(self, r: LoadRow, req: _Request) -> int:
        """Tokens ``req`` adds to ``r`` after reusing the prefix ``r`` probably holds."""
        if not self.cache_aware:
            return 0
        summary = self._summaries.get(r.worker)
        bs = r.block_size
        held = 0
        if summary is not None and req.hashes and bs > 0:
            held = summary.count_prefix(req.hashes)
        tiers = getattr(req.hashes, "tiers", None)
        if tiers is not None and r.role is not Role.DECODE and self._on_tier_node(r):
            held += tiers.run(held)
        bs = max(bs, 1)
        # As the engines reuse: prefill recomputes at least the prompt's last token (so a
        # prompt ending on a block boundary recomputes that block); decode imports the KV
        # of the prompt's full blocks, the first output token lies past them.
        compute = req.prompt_len - min(held, (req.prompt_len - 1) // bs) * bs
        store = req.prompt_len + req.max_tokens - min(held, req.prompt_len // bs) * bs
        if r.role is Role.PREFILL:
            return compute
        return store if r.role is Role.DECODE else compute + store

    def _on_tier_node(self, r: LoadRow) -> bool:
        assert self._tiers is not None
        return r.node == self._tiers.node

    def _commit(
        self, p_row: LoadRow, d_row: LoadRow, prompt_len: int, max_tokens: int
    ) -> Placement:
        ticket = next(self._tickets)
        p_books, d_books = self.ledger.of(p_row), self.ledger.of(d_row)
        p_books.sent_requests += 1
        p_books.sent_tokens += prompt_len
        d_books.reserved[ticket] = prompt_len + max_tokens
        placement = Placement(
            prefill=p_row.index,
            decode=d_row.index,
            ticket=ticket,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            prefill_generation=p_row.generation,
            decode_generation=d_row.generation,
            colocated=p_row.role is Role.COLOCATED,
        )
        p_key, d_key = placement.keys
        if p_key == d_key:  # co-located: one worker does both halves
            self.ledger.count(p_key, prompt_len + max_tokens)
        else:
            self.ledger.count(p_key, prompt_len)
            self.ledger.count(d_key, prompt_len + max_tokens)
        self.ledger.publish(p_key)
        self.ledger.publish(d_key)
        return placement


class PromptBlocks(list[int]):
    """A prompt's block hashes (what prefix summaries are keyed by), and what the host's
    tiers hold of it (None: no tiers)."""

    tiers: TierQuery | None = None


@dataclass(frozen=True)
class _Request:
    """What placement knows of a request: sizes, and its block hashes (cache-aware)."""

    prompt_len: int
    max_tokens: int
    hashes: Sequence[int] = ()
    lora: str | None = None  # the LoRA adapter's fingerprint


def _roles(rows: list[LoadRow]) -> tuple[Role, Role]:
    """The (prefill, decode) roles of a placement: a co-located server has one of each."""
    if any(r.role is Role.COLOCATED for r in rows):
        return Role.COLOCATED, Role.COLOCATED
    return Role.PREFILL, Role.DECODE
