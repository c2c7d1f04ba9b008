"""Every shared resource of one server, created by the launcher before any child starts.

The launcher creates all rings, doorbells, the load table and the prefill KV pools, then
hands each child the fds it needs (``subprocess.Popen(pass_fds=...)``) and a JSON
``ProcessSpec`` naming them. Segment names are unlinked the moment they are created, so
nothing of ours is ever visible in /dev/shm, and a restarted child attaches to the very
same memory through the same inherited fds.

Ring names (i = prefill, j = decode, c = co-located worker, k = detokenizer shard):
    req.p{i}      frontend -> prefill i     GenerateRequest, AbortRequest
    ctl.d{j}      frontend -> decode j      AbortRequest
    ctl.k{k}      frontend -> detok k       DetokRegister, AbortRequest
    kv.p{i}.d{j}  prefill i -> decode j     KVTransfer
    rel.d{j}.p{i} decode j -> prefill i     KVRelease
    tok.p{i}.k{k} prefill i -> detok k      TokenBatch (first tokens)
    tok.d{j}.k{k} decode j -> detok k       TokenBatch
    stop.k{k}.d{j} detok k -> decode j      AbortRequest (a stop string matched)
    text.k{k}     detok k -> frontend       TextBatch
With ``--colocated N`` there are no prefill/decode pools and no KV rings; instead:
    req.c{c}       frontend -> colocated c   GenerateRequest, AbortRequest
    tok.c{c}.k{k}  colocated c -> detok k    TokenBatch (first and later tokens)
    stop.k{k}.c{c} detok k -> colocated c    AbortRequest (a stop string matched)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pdserve.process import ProcessSpec
from router.load_table import LoadTable
from transport.doorbell import Doorbell
from transport.kv import KVLayout, create_pool_segment
from transport.ring import Ring
from transport.segment import Segment

MiB = 1 << 20
# Capacities: a request ring holds long prompts; token rings a few steps of a full batch
# with top-20 logprobs (~46 KB per 256-request step); control rings small records.
RING_BYTES = {"req": 8 * MiB, "kv": 4 * MiB, "tok": 4 * MiB, "text": 8 * MiB}
SMALL_RING_BYTES = 256 * 1024


def _ring_capacity(name: str) -> int:
    return RING_BYTES.get(name.split(".")[0], SMALL_RING_BYTES)


class Topology:
    """Creates and owns (keeps open) every ring, doorbell and segment of a server."""

    def __init__(
        self, num_prefill: int, num_decode: int, num_detok: int, num_colocated: int = 0
    ) -> None:
        self.p, self.d, self.k, self.c = num_prefill, num_decode, num_detok, num_colocated
        names = ["frontend"] + [f"p{i}" for i in range(self.p)]
        names += [f"d{j}" for j in range(self.d)] + [f"k{k}" for k in range(self.k)]
        names += [f"c{c}" for c in range(self.c)]
        self.doorbells = {name: Doorbell.create() for name in names}
        self.rings: dict[str, Ring] = {}
        self._consumer: dict[str, str] = {}
        self._producer: dict[str, str] = {}
        self._build_rings()
        self.num_workers = self.p + self.d + self.c
        nbytes = LoadTable.layout_nbytes(self.num_workers)
        self.load_segment = Segment.create("load", nbytes)
        LoadTable(self.load_segment.buf, self.num_workers)  # writes the header
        self.kv_segments: dict[str, tuple[Segment, KVLayout]] = {}

    def _add(self, name: str, producer: str, consumer: str) -> None:
        self.rings[name] = Ring.create(name, _ring_capacity(name), self.doorbells[consumer])
        self._producer[name], self._consumer[name] = producer, consumer

    def _build_rings(self) -> None:
        for i in range(self.p):
            self._add(f"req.p{i}", "frontend", f"p{i}")
            for k in range(self.k):
                self._add(f"tok.p{i}.k{k}", f"p{i}", f"k{k}")
            for j in range(self.d):
                self._add(f"kv.p{i}.d{j}", f"p{i}", f"d{j}")
                self._add(f"rel.d{j}.p{i}", f"d{j}", f"p{i}")
        for j in range(self.d):
            self._add(f"ctl.d{j}", "frontend", f"d{j}")
            for k in range(self.k):
                self._add(f"tok.d{j}.k{k}", f"d{j}", f"k{k}")
                self._add(f"stop.k{k}.d{j}", f"k{k}", f"d{j}")
        for c in range(self.c):
            self._add(f"req.c{c}", "frontend", f"c{c}")
            for k in range(self.k):
                self._add(f"tok.c{c}.k{k}", f"c{c}", f"k{k}")
                self._add(f"stop.k{k}.c{c}", f"k{k}", f"c{c}")
        for k in range(self.k):
            self._add(f"ctl.k{k}", "frontend", f"k{k}")
            self._add(f"text.k{k}", f"k{k}", "frontend")

    def add_kv_pool(self, prefill: int, layout: KVLayout) -> None:
        """The shared segment decode workers copy prefill ``prefill``'s blocks from."""
        self.kv_segments[f"p{prefill}"] = (create_pool_segment(f"p{prefill}", layout), layout)

    def spec(self, role: str, index: int, settings: dict[str, Any]) -> ProcessSpec:
        me = {"prefill": "p", "decode": "d", "detok": "k", "colocated": "c"}.get(role, "") + (
            str(index) if role != "frontend" else "frontend"
        )
        # Slots: prefill workers, then decode workers; a colocated server has only c rows.
        slot = {"prefill": index, "decode": self.p + index, "colocated": index}.get(role, -1)
        kv_pools = {
            name: {"fd": seg.spec.fd, "nbytes": seg.spec.nbytes, "layout": asdict(layout)}
            for name, (seg, layout) in self.kv_segments.items()
            if name == me or role == "decode"
        }
        return ProcessSpec(
            role=role,
            index=index,
            doorbell_fd=self.doorbells[me].fd,
            rings_in={n: asdict(r.spec) for n, r in self.rings.items() if self._consumer[n] == me},
            rings_out={n: asdict(r.spec) for n, r in self.rings.items() if self._producer[n] == me},
            load_table={
                "fd": self.load_segment.spec.fd,
                "nbytes": self.load_segment.spec.nbytes,
                "num_workers": self.num_workers,
                "slot": slot,
            },
            kv_pools=kv_pools,
            settings=settings,
        )

    def _load_table_spec(self, slot: int) -> dict[str, Any]:
        seg = self.load_segment.spec
        return {"fd": seg.fd, "nbytes": seg.nbytes, "num_workers": self.num_workers, "slot": slot}

    def load_table(self) -> LoadTable:
        return LoadTable(self.load_segment.buf, self.num_workers)
