"""A node's gateway: ``python -m cluster.gateway`` (started by the launcher of a node of a
cluster; ``docs/multi_host.md`` has the design).

Every ring of a node that has a peer on another host at its other end has this process
at its local end instead (``launcher/topology.py``): it drains those rings onto the
cluster link (``transport/link/``, one ``Relay`` per record, the record's bytes
untouched) and writes what arrives into the named local rings. Rings stay single-producer,
single-consumer, and workers do not know which of their peers are remote.

Two kinds of gateway:

  head     listens on the advertised address. A member's ``Join`` gets decode indices
           from the ``--remote-decode`` reserve (the same ones again when the same node
           joins anew) and the cluster's shape, or a refusal naming why: another model,
           or a KV layout whose blocks differ (dtype, block size, heads). It writes each
           member's workers' rows into the local load table (``RowWriter.mirror``), so
           routers, recovery and ``/health`` see them as they see local ones, and marks
           them DEAD when the member falls silent.
  member   connects to the head, sends its decode workers' rows with every heartbeat
           (their ages, not their clocks) and relays its rings both ways.

A record that arrives for a ring this gateway does not hold, or that does not decode, is
logged and dropped: the link is authenticated, so that is a bug or a version skew, and
one bad record must not stop the others. Nothing spins: between records the process
sleeps on its doorbell and the link's socket together.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

from cluster.membership import GatewaySpec, Member, join_refusal, reserve_for
from runtime.process import attach_rings, bootstrap
from runtime.strict_spec import EXIT_BAD_SPEC, exit_on_bad_spec
from transport.errors import LinkError, PeerDead, RingFull
from transport.link.client import LinkClient
from transport.link.server import LinkServer
from transport.load_table import (
    LoadTable,
    WorkerState,
    row_fields,
    row_from_fields,
)
from transport.ring import Ring
from transport.segment import Segment, SegmentSpec
from wire import records
from wire.kv_layout import KVLayout
from wire.link_records import Join, Relay, Rows, Welcome
from wire.ring_names import RingName
from wire.roles import Role

logger = logging.getLogger(__name__)

_PUT_TIMEOUT_S = 5.0  # a local ring stays full this long: its consumer is stuck
_SEND_TIMEOUT_S = 1.0
_MAX_DRAIN = 256  # records per ring per pass, so one busy ring cannot starve the link


@dataclass
class _Rings:
    """The gateway's rings; a ring's name is parsed and formatted once, not per record."""

    inbound: dict[RingName, tuple[str, Ring]]  # name -> (its text, as a Relay names it)
    outbound: dict[str, tuple[RingName, Ring]]  # a Relay's ring text -> (name, ring)
    stats: dict[str, int] = field(default_factory=lambda: {"out": 0, "in": 0, "dropped": 0})


def _table(spec_table: dict[str, int]) -> tuple[LoadTable, Segment]:
    seg = Segment.attach(SegmentSpec("load", spec_table["fd"], spec_table["nbytes"]))
    return LoadTable(seg.buf, spec_table["num_workers"]), seg


class Gateway:
    def __init__(self) -> None:
        spec, self.stopping = bootstrap()
        self.cfg = exit_on_bad_spec(spec.settings, GatewaySpec)
        rings = attach_rings(spec)
        self.rings = _Rings(
            {n: (str(n), r) for n, r in rings.inbound.items()},
            {str(n): (n, r) for n, r in rings.outbound.items()},
        )
        self.doorbell = rings.doorbell
        self.table, self._table_seg = _table(spec.load_table)
        self.layout = KVLayout.from_json(self.cfg.layout)
        self.members: dict[str, Member] = {}
        self.server: LinkServer | None = None
        self.client: LinkClient | None = None
        self._handshakes = 0  # of the link to the head, when this node last joined
        self._join_sent: float | None = None  # when, while its Welcome has not come
        self._head_silent = False  # said once per silence, not every beat

    # -- relaying ----------------------------------------------------------------------

    def _pump(self) -> bool:
        """Drain the rings whose other end is remote onto the link; True if any moved."""
        moved = False
        for name, (text, ring) in self.rings.inbound.items():
            batch = ring.drain(_MAX_DRAIN)
            for payload in batch:
                self._send(name, Relay(text, bytes(payload)))
            moved |= bool(batch)
        return moved

    def _send(self, name: RingName, relay: Relay) -> None:
        try:
            if self.client is not None:
                self.client.send_link(relay, _SEND_TIMEOUT_S)
            else:
                member = self._owner(name)
                if member is None or not member.identity:
                    self.rings.stats["dropped"] += 1
                    logger.warning("ring %s: no node holds its far end; record dropped", name)
                    return
                assert self.server is not None
                self.server.send_link(member.identity, relay, _SEND_TIMEOUT_S)
            self.rings.stats["out"] += 1
        except LinkError as e:
            self.rings.stats["dropped"] += 1
            logger.error("ring %s: record not sent to its node: %s", name, e)

    def _owner(self, name: RingName) -> Member | None:
        """The member node holding the remote end of ``name`` (the head's view)."""
        remote = name.dst if name.dst.role is Role.DECODE else name.src
        return next((m for m in self.members.values() if remote.index in m.decode), None)

    def _deliver(self, relay: Relay, sender: Member | None) -> None:
        held = self.rings.outbound.get(relay.ring)
        if held is None:
            self.rings.stats["dropped"] += 1
            logger.warning(
                "a record for ring %s, which this node does not relay; dropped", relay.ring
            )
            return
        name, ring = held
        if sender is not None and name.src.index not in sender.decode:
            self.rings.stats["dropped"] += 1
            logger.warning(
                "node %s sent a record for %s, not one of its rings; dropped",
                sender.node,
                relay.ring,
            )
            return
        try:
            records.decode(relay.payload)
        except Exception as e:  # any decoding failure: only this record is bad
            self.rings.stats["dropped"] += 1
            logger.warning("ring %s: a record that does not decode (%s); dropped", relay.ring, e)
            return
        try:
            ring.put(relay.payload, timeout=_PUT_TIMEOUT_S)
            self.rings.stats["in"] += 1
        except RingFull:
            self.rings.stats["dropped"] += 1
            logger.error(
                "ring %s stayed full for %.0f s; a record from the link is lost",
                relay.ring,
                _PUT_TIMEOUT_S,
            )
        except PeerDead as e:
            # The worker it was for died: its successor resets the ring and starts afresh,
            # and the frontend resumes what the dead one held. The gateway lives on.
            self.rings.stats["dropped"] += 1
            logger.warning("ring %s: %s; a record from the link is dropped", relay.ring, e)

    # -- the head ----------------------------------------------------------------------

    def _on_join(self, identity: bytes, join: Join) -> None:
        assert self.server is not None
        refused = join_refusal(join, self.cfg, self.layout, self.members)
        if refused:
            logger.warning("refused node %s: %s", join.node, refused)
            self.server.send_link(identity, Welcome(-1, "", refused), _SEND_TIMEOUT_S)
            return
        member = self.members.get(join.node)
        if member is None:
            decode = reserve_for(join, self.cfg, self.members)
            member = self.members[join.node] = Member(join.node, decode)
        member.identity, member.last_heard = identity, time.monotonic()
        logger.info("node %s joined with decode workers %s", join.node, member.decode)
        self.server.send_link(identity, Welcome(member.decode[0], self.cfg.shape), _SEND_TIMEOUT_S)

    def _on_rows(self, identity: bytes, rows: Rows) -> Member | None:
        member = self.members.get(rows.node)
        if member is None:
            logger.warning("rows from node %s, which has not joined; ignored", rows.node)
            return None
        member.identity, member.last_heard = identity, time.monotonic()
        if member.silent:
            logger.info("node %s is heard again", member.node)
            member.silent = False
        now = time.monotonic_ns()
        for fields in rows.rows:
            age = fields.pop("age_ns", 0)
            try:
                row = row_from_fields(-1, fields)
            except ValueError as e:
                logger.warning("node %s sent a bad row (%s); ignored", member.node, e)
                continue
            if row.role is not Role.DECODE or row.index not in member.decode:
                logger.warning(
                    "node %s sent a row for %s-%d, not one of its workers",
                    member.node,
                    row.role,
                    row.index,
                )
                continue
            # Named after the member that joined, whatever its row says.
            writer = self.table.writer(self.cfg.num_prefill + row.index)
            writer.mirror(row, now - max(0, age), member.node)
        return member

    def _check_silence(self) -> None:
        cutoff = time.monotonic() - self.cfg.silent_after_s
        for m in self.members.values():
            if m.silent or not m.identity or m.last_heard >= cutoff:
                continue
            m.silent = True
            logger.error(
                "node %s silent for %.1f s: its decode workers %s are marked dead",
                m.node,
                self.cfg.silent_after_s,
                m.decode,
            )
            for g in m.decode:
                w = self.table.writer(self.cfg.num_prefill + g)
                w.mark_exited(WorkerState.DEAD, 0, Role.DECODE, g)

    def _serve_head(self) -> None:
        self.server = LinkServer(self.cfg.listen, self.cfg.cluster_key, self.cfg.node)
        logger.info("cluster link listening on %s", self.server.endpoint)
        self._loop(self._head_messages, self._head_beat)

    def _head_messages(self) -> bool:
        assert self.server is not None
        got_any = False
        while (got := self.server.recv(0)) is not None:
            got_any = True
            identity, msg = got
            if isinstance(msg, Join):
                self._on_join(identity, msg)
            elif isinstance(msg, Rows):
                self._on_rows(identity, msg)
            elif isinstance(msg, Relay):
                sender = next((m for m in self.members.values() if m.identity == identity), None)
                if sender is None:
                    logger.warning("a relay from a peer whose node sent no rows yet; dropped")
                    continue
                self._deliver(msg, sender)
            else:
                logger.warning("unexpected %s from a member; ignored", type(msg).__name__)
        return got_any

    def _head_beat(self) -> None:
        assert self.server is not None
        self.server.send_beat()
        self._check_silence()

    # -- a member ----------------------------------------------------------------------

    def _serve_member(self) -> None:
        self.client = LinkClient(self.cfg.join, self.cfg.cluster_key, self.cfg.node)
        self.client.connect(timeout=30.0)
        logger.info("connected to the head at %s", self.cfg.join)
        self._join()
        self._loop(self._member_messages, self._member_beat)

    def _member_messages(self) -> bool:
        assert self.client is not None
        got_any = False
        while (msg := self.client.recv(0)) is not None:
            got_any = True
            if isinstance(msg, Relay):
                self._deliver(msg, None)
            elif isinstance(msg, Welcome):
                self._welcomed(msg)
            else:
                logger.warning("unexpected %s from the head; ignored", type(msg).__name__)
        if self.client.handshakes > self._handshakes:
            self._join()
        return got_any

    def _join(self) -> None:
        """Join the head, asking for the indices this node's workers run under: on every
        new connection (the link greets the head again by itself), since it may reach a
        head whose gateway restarted and knows no member; and again while no answer has
        come (``_member_beat``). A head that knows this node already answers the same."""
        assert self.client is not None
        self._handshakes = self.client.handshakes
        self._join_sent = time.monotonic()
        mine = self.cfg.decode
        join = Join(self.cfg.node, len(mine), self.cfg.layout, self.cfg.model, base=mine[0])
        try:
            self.client.send_link(join, _SEND_TIMEOUT_S)
        except LinkError as e:  # asked again after silent_after_s
            logger.warning("could not send the join to the head: %s", e)

    def _welcomed(self, answer: Welcome) -> None:
        if answer.refused:
            # The head now serves another model, or gave these indices to another node:
            # this node's workers cannot serve it, and a restart would be refused alike.
            logger.error("the head refused this node: %s", answer.refused)
            raise SystemExit(EXIT_BAD_SPEC)
        if self._join_sent is not None:
            logger.info("the head admits this node's decode workers %s", self.cfg.decode)
        self._join_sent = None

    def _member_beat(self) -> None:
        assert self.client is not None
        now = time.monotonic_ns()
        mine = set(self.cfg.decode)
        rows = []
        for r in self.table.snapshot():
            if r.role is Role.DECODE and r.index in mine:
                rows.append({**row_fields(r), "age_ns": max(0, now - r.heartbeat_ns)})
        try:
            self.client.send_link(Rows(self.cfg.node, rows), _SEND_TIMEOUT_S)
            self.client.send_beat()
        except LinkError as e:
            logger.warning("heartbeat to the head failed: %s", e)
        sent = self._join_sent
        if sent is not None and time.monotonic() - sent > self.cfg.silent_after_s:
            self._join()  # no answer: the head may not have been there to hear it
        silent = bool(self.client.silent_peers(self.cfg.silent_after_s))
        if silent and not self._head_silent:
            logger.error("the head has been silent for %.1f s", self.cfg.silent_after_s)
        elif self._head_silent and not silent:
            logger.info("the head is heard again")
        self._head_silent = silent

    # -- the loop ----------------------------------------------------------------------

    def _loop(self, messages: object, beat: object) -> None:
        assert callable(messages) and callable(beat)
        link = self.server if self.server is not None else self.client
        assert link is not None
        inbound = [ring for _, ring in self.rings.inbound.values()]
        next_beat = 0.0
        while not self.stopping:
            busy = self._pump()
            busy |= bool(messages())
            now = time.monotonic()
            if now >= next_beat:
                beat()
                next_beat = now + self.cfg.beat_s
            if busy or self.doorbell.arm(inbound):
                continue
            link.wait([self.doorbell.fileno()], min(max(0.0, next_beat - now), 0.5))
            self.doorbell.clear()

    def run(self) -> None:
        logger.info(
            "gateway of node %s (pid %d): %d rings in, %d out",
            self.cfg.node,
            os.getpid(),
            len(self.rings.inbound),
            len(self.rings.outbound),
        )
        try:
            if self.cfg.listen:
                self._serve_head()
            else:
                self._serve_member()
        finally:
            for link in (self.server, self.client):
                if link is not None:
                    link.close()
            logger.info("gateway stops: %s", json.dumps(self.rings.stats))


def main() -> None:
    Gateway().run()


if __name__ == "__main__":
    main()
