"""Decode CUDA graphs and the staging of every per-step input they replay from.

* ``StepInputs``: all of a step's integer inputs (token ids, positions, KV slots, block
  table rows, context lengths, query starts, LoRA rows and tiles, block-table updates)
  packed into ONE host
  buffer (pinned on CUDA) and sent by ONE non-blocking copy into ONE persistent device
  buffer, whose fixed views the kernels read. A captured graph holds those views'
  addresses, so refilling the buffer is all a replay needs.
* ``graph_buckets`` / ``bucket_for`` / ``pad_decode``: a decode batch of n sequences runs
  the graph of the smallest bucket >= n, its extra rows padded to do nothing (no KV write,
  context length 0, output ignored).
* ``DecodeGraphs``: one graph per bucket, captured on first use, replayed after. It
  captures up to the final norm's hidden states; the vocabulary projection and sampling
  run outside (see ``engine.model.causal_lm.CausalLM.hidden``).

Bucket choice, padding and staging are plain functions and objects, tested on CPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.cuda.lora_tiles import max_tiles
from engine.kv.block_table_rows import PAD_ROW

logger = logging.getLogger(__name__)
_NONE = np.zeros(0, dtype=np.int32)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8, and max_num_seqs."""
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return [*small, *range(8, max_num_seqs, 8), max_num_seqs]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (sorted ``buckets``), or None when n exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class StepArrays:
    """One step's integer inputs on the host, int32: T tokens of B sequences."""

    token_ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,)
    slots: np.ndarray  # (T,) pool slot of each token (block * block_size + offset); -1: none
    seq_rows: np.ndarray  # (B,) block-table row of each sequence
    ctx_lens: np.ndarray  # (B,) context length after this step
    logits_rows: np.ndarray  # (B,) the token whose logits are wanted: each chunk's last
    q_starts: np.ndarray  # (B + 1,) cumulative token counts
    # With LoRA rows only (engine/cuda/lora_tiles.py): rows grouped by adapter, and the
    # (3, M) tile table flattened; empty when every row is base.
    lora_order: np.ndarray = field(default_factory=lambda: _NONE)
    lora_tiles: np.ndarray = field(default_factory=lambda: _NONE)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_rows.shape[0])


def pad_decode(a: StepArrays, bucket: int) -> StepArrays:
    """A decode batch (one token per sequence) padded to ``bucket`` rows that do nothing:
    token 0 at position 0, no KV slot, the padding block-table row, context length 0."""
    n = a.num_seqs
    assert a.num_tokens == n <= bucket, (a.num_tokens, n, bucket)
    pad = bucket - n

    def ext(x: np.ndarray, value: int) -> np.ndarray:
        return np.concatenate((x, np.full(pad, value, dtype=np.int32)))

    rows = np.arange(bucket, dtype=np.int32)
    return StepArrays(
        token_ids=ext(a.token_ids, 0),
        positions=ext(a.positions, 0),
        slots=ext(a.slots, -1),
        seq_rows=ext(a.seq_rows, PAD_ROW),
        ctx_lens=ext(a.ctx_lens, 0),
        logits_rows=rows,
        q_starts=np.arange(bucket + 1, dtype=np.int32),
    )


_TOKEN_FIELDS = ("token_ids", "positions", "slots", "lora_order")
_SEQ_FIELDS = ("seq_rows", "ctx_lens", "logits_rows")


class StepInputs:
    """One host buffer and one device buffer of int32 holding every per-step input.

    Layout: token fields (``max_tokens`` each), sequence fields (``max_seqs`` each),
    ``q_starts`` (``max_seqs + 1``), the LoRA tile table (as many tiles as a step of
    that size may need), then block-table updates as (flat index, block)
    pairs (``max_updates`` pairs). ``stage`` writes the host buffer and copies its used
    prefix to the device in one non-blocking copy; ``view`` slices the device buffer.
    A step larger than the buffers reallocates them and bumps ``generation`` (graphs
    captured on the old device buffer must be recaptured).
    """

    def __init__(
        self, max_tokens: int, max_seqs: int, max_updates: int, device: torch.device
    ) -> None:
        self.device = device
        self.generation = 0
        self._done: torch.cuda.Event | None = None
        self._allocate(max_tokens, max_seqs, max_updates)

    def _allocate(self, max_tokens: int, max_seqs: int, max_updates: int) -> None:
        self.max_tokens, self.max_seqs, self.max_updates = max_tokens, max_seqs, max_updates
        self._offsets: dict[str, int] = {}
        at = 0
        for name, size in [
            *((f, max_tokens) for f in _TOKEN_FIELDS),
            *((f, max_seqs) for f in _SEQ_FIELDS),
            ("q_starts", max_seqs + 1),
            ("lora_tiles", 3 * max_tiles(max_tokens, max_seqs)),
            ("updates", 2 * max_updates),
        ]:
            self._offsets[name] = at
            at += size
        pin = self.device.type == "cuda"  # DMA, and what makes non_blocking truly async
        self.host = torch.zeros(at, dtype=torch.int32, pin_memory=pin)
        self._host_np = self.host.numpy()
        self.dev = torch.zeros(at, dtype=torch.int32, device=self.device)
        self.generation += 1

    def stage(self, a: StepArrays, updates: Sequence[int]) -> None:
        """Fill the host buffer with ``a`` and ``updates`` (flat index, block, ...) and start
        the one host -> device copy of its used prefix."""
        u = len(updates) // 2
        if a.num_tokens > self.max_tokens or a.num_seqs > self.max_seqs or u > self.max_updates:
            self._allocate(
                _grown(a.num_tokens, self.max_tokens),
                _grown(a.num_seqs, self.max_seqs),
                _grown(u, self.max_updates),
            )
        if self._done is not None and not self._done.query():
            # NOTE: the previous step's copy is still reading the pinned buffer. Rare: the
            # step's sample, read on the host, waited for everything queued before it.
            self._done.synchronize()
        h, off = self._host_np, self._offsets
        for name in (*_TOKEN_FIELDS, *_SEQ_FIELDS, "q_starts", "lora_tiles"):
            values = getattr(a, name)
            h[off[name] : off[name] + len(values)] = values
        end = off["updates"] + 2 * u
        h[off["updates"] : end] = updates
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first ``n`` device entries of field ``name`` (a fixed address per (name, n))."""
        return self.dev[self._offsets[name] : self._offsets[name] + n]

    def apply_updates(self, table: torch.Tensor, n: int) -> None:
        """Scatter the staged ``n`` (flat index, block) pairs into ``table`` on device."""
        if n:
            pairs = self.view("updates", 2 * n).view(n, 2)
            table.view(-1).index_copy_(0, pairs[:, 0].long(), pairs[:, 1])


def _grown(need: int, have: int) -> int:
    """Capacity for ``need``: ``have`` if enough, else at least double (few reallocations)."""
    return have if need <= have else max(need, 2 * have)


class DecodeGraphs:
    """One CUDA graph per batch-size bucket of ``forward(bucket) -> hidden (bucket, D)``.

    ``forward`` must read only persistent buffers (``StepInputs`` views, the block
    table, the pool). ``key`` names those buffers' identity: when it changes, every
    graph is dropped and recaptured on next use. A capture that runs out of memory
    leaves that bucket eager, with a warning.
    """

    def __init__(self, forward: Callable[[int], torch.Tensor], device: torch.device) -> None:
        self._forward = forward
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._eager: set[int] = set()
        self._key: object = None
        self._pool: Any = None  # graph.pool() of the first capture: all graphs share it

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def run(self, bucket: int, key: object) -> torch.Tensor:
        """Run the decode forward for ``bucket`` rows of the staged inputs."""
        if key != self._key:
            # NOTE: the shared memory pool goes with its graphs: a pool handle outlives its
            # last graph only as a dangling id, and capturing into it trips the caching
            # allocator's "use_count > 0" assert (seen on an H200 when buffers regrew).
            self._graphs.clear()
            self._pool = None
            self._key = key
        if bucket in self._eager:
            return self._forward(bucket)
        entry = self._graphs.get(bucket)
        if entry is None:
            entry = self._capture(bucket)
            if entry is None:
                return self._forward(bucket)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        # Warm up first, on the staged (real) inputs: compiles the Triton kernels and lets
        # cuBLAS set up, neither of which may happen during capture. The warm-up's KV
        # writes are the ones the replay makes again: same inputs, same values.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls another thread makes meanwhile (a KV copy) are its
            # own business, not an error of this capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._forward(bucket)
        except RuntimeError as e:  # OutOfMemoryError included
            # NOTE: the forward itself just ran (warm-up): what failed is the capture.
            logger.warning(
                "decode batch size %d runs eager: its CUDA graph capture failed (%s)", bucket, e
            )
            self._eager.add(bucket)
            return None
        self._pool = graph.pool()
        self._graphs[bucket] = (graph, out)
        logger.debug("captured the decode CUDA graph for batch size %d", bucket)
        return graph, out
