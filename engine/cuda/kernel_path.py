"""``ModelRunner``'s forward on the Triton kernels (the CUDA path), with decode graphs.

Who calls what: ``ModelRunner`` builds one when its attention backend is Triton (the
default on CUDA; ``EngineConfig.attention_backend``) and hands it every forward
(``forward``), every freed sequence (``release``), and, once the KV pool is final,
``enable_graphs`` (unless ``enforce_eager``); a worker that decodes then captures every
bucket's graph before it serves (``capture_decode_graphs``).

One step, host side: per sequence, its block-table row (new blocks become updates), its
positions and KV slots; all of it staged into ``StepInputs`` and sent in one non-blocking
copy. No ``torch.tensor(..., device=)`` and no block table rebuilt: what the device needs
already sits in persistent buffers. A decode batch of n rows runs the CUDA graph of the
smallest bucket >= n (padded rows do nothing); prefill, and decode past the largest
bucket or with graphs off, runs the same kernels eagerly.

LoRA: a step with adapter rows also stages its rows grouped by adapter and their tile
table (``lora_tiles.py``); every linear layer's stacked bank (``lora_bank.py``) then adds
the updates with two Triton launches. A decode batch with adapter rows replays a graph
of its own per bucket (``lora_graphs``, its tile grid fixed at the most tiles the bucket
can need); a batch of base rows keeps the plain graphs, which hold no LoRA launches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda.graphs import (
    DecodeGraphs,
    StepArrays,
    StepInputs,
    bucket_for,
    graph_buckets,
    pad_decode,
)
from engine.cuda.kernels.backend import KernelBatch, TritonBackend
from engine.cuda.kernels.decode_attention import num_kv_splits
from engine.cuda.lora_tiles import max_tiles, plan_tiles
from engine.kv.block_table_rows import BlockTableRows
from engine.model.causal_lm import CausalLM
from engine.weights.lora import LoraTiles, lora_rows

if TYPE_CHECKING:
    from engine.kv.sequence import Sequence

logger = logging.getLogger(__name__)

Span = tuple["Sequence", int, int]  # (sequence, first new position, new tokens)


class KernelPath:
    def __init__(
        self, model: CausalLM, m: ModelConfig, config: EngineConfig, max_model_len: int
    ) -> None:
        self.model = model
        self.backend = TritonBackend(model.rotary.cos, model.rotary.sin)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.kv_heads = m.num_kv_heads
        device = next(model.parameters()).device
        width = -(-max_model_len // self.block_size) + 1  # + 1: decode admission's spare
        seqs = config.max_num_seqs
        self.rows = BlockTableRows(width, capacity=2 * seqs + 2, device=device)
        # NOTE: a step copies only the used prefix of the buffers, and updates come last:
        # room for many (an admission wave of long prompts) costs pinned memory, not copies.
        self.inputs = StepInputs(
            max(config.chunked_prefill_size, seqs),
            seqs,
            max_updates=max(1 << 16, 2 * seqs + width),
            device=device,
        )
        self.buckets = graph_buckets(seqs)
        self.max_loras = config.max_loras
        self.graphs: DecodeGraphs | None = None
        self.lora_graphs: DecodeGraphs | None = None  # decode batches with adapter rows
        self._pool: torch.Tensor | None = None  # the pool graphs read (set before a run)
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )

    def enable_graphs(self) -> None:
        """Capture decode graphs from now on (the pool they read must not change after)."""
        device = self.rows.table.device
        self.graphs = DecodeGraphs(self._graph_forward, device)
        if self.max_loras > 0:
            self.lora_graphs = DecodeGraphs(lambda b: self._graph_forward(b, True), device)

    def capture_decode_graphs(self, pool: torch.Tensor) -> None:
        """Capture every bucket's decode graph now, on all-padding batches (no KV write).
        Captured on first use instead, the first step to reach a new bucket waited for the
        capture and for the Triton compile of the bucket's split count: seconds of one
        inter-token gap on a fresh host (seen on an H200). Graphs whose buffers change
        later are recaptured on use, as before."""
        if self.graphs is None:
            return
        t0 = time.perf_counter()
        empty = np.zeros(0, dtype=np.int32)
        no_rows = StepArrays(empty, empty, empty, empty, empty, empty, np.zeros(1, np.int32))
        self._pool = pool
        for bucket in self.buckets:
            self.inputs.stage(pad_decode(no_rows, bucket), [])
            self.graphs.run(bucket, self._graph_key(pool))
        torch.cuda.synchronize(pool.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes 1-%d) in %.1f s",
            len(self.buckets),
            self.buckets[-1],
            time.perf_counter() - t0,
        )

    def release(self, seq: Sequence) -> None:
        self.rows.release(seq)

    def reset(self) -> None:
        self.rows.reset()

    def forward(
        self,
        spans: list[Span],
        tokens: list[int],
        is_decode: bool,
        pool: torch.Tensor,
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """-> float32 logits (len(spans), vocab) at each span's last token. ``lora_slots``:
        each span's adapter slot (-1: base), None when every span is base."""
        updates: list[int] = []
        bucket = None
        graphs = self.graphs if lora_slots is None else self.lora_graphs
        tiles = 0  # the LoRA tile grid (0: no adapter rows)
        try:
            arrays = self._arrays(spans, tokens, is_decode, updates)
            if is_decode and graphs is not None:
                bucket = bucket_for(len(spans), self.buckets)
                if bucket is not None:
                    arrays = pad_decode(arrays, bucket)
            if lora_slots is not None:
                arrays, tiles = self._with_lora(arrays, spans, lora_slots, bucket)
            self.inputs.stage(arrays, updates)
        except BaseException:
            self.rows.forget_written()  # the device table may lack updates counted as sent
            raise
        self.inputs.apply_updates(self.rows.table, len(updates) // 2)
        n = len(spans)
        if bucket is not None:
            assert graphs is not None
            self._pool = pool
            hidden = graphs.run(bucket, self._graph_key(pool))[:n]
        elif is_decode:
            splits = num_kv_splits(n, self.kv_heads, int(arrays.ctx_lens.max()), self._num_sms)
            hidden = self._hidden(pool, self._batch(n, n, True, splits), tiles)
        else:
            max_q = max(count for _, _, count in spans)
            batch = self._batch(len(tokens), n, False, 0, max_q_len=max_q)
            hidden = self._hidden(pool, batch, tiles)
        return self.model.logits(hidden)

    def _graph_key(self, pool: torch.Tensor) -> tuple[int, int, int]:
        """The identity of the buffers a graph reads: a change recaptures every graph."""
        return (self.inputs.generation, self.rows.generation, pool.data_ptr())

    def _graph_forward(self, bucket: int, lora: bool = False) -> torch.Tensor:
        assert self._pool is not None
        # NOTE: splits are fixed per bucket (the graph's grid), sized for the longest context.
        splits = num_kv_splits(bucket, self.kv_heads, self.max_model_len, self._num_sms)
        tiles = self._lora_grid(bucket) if lora else 0
        return self._hidden(self._pool, self._batch(bucket, bucket, True, splits), tiles)

    def _hidden(self, pool: torch.Tensor, batch: KernelBatch, tiles: int = 0) -> torch.Tensor:
        """The one forward on the Triton backend, without the vocabulary projection;
        ``tiles``: the staged LoRA tile grid (0: every row is base)."""
        rows = None
        if tiles:
            v, t = self.inputs.view, batch.token_ids.shape[0]
            rows = LoraTiles(v("lora_order", t), v("lora_tiles", 3 * tiles).view(3, tiles))
        with lora_rows(rows):
            return self.model.hidden(batch.token_ids, pool, batch, self.backend, batch.logits_rows)

    def _lora_grid(self, bucket: int) -> int:
        """A graph bucket's LoRA tile grid: the most tiles any of its batches can need."""
        return max_tiles(bucket, min(bucket, self.max_loras))

    def _with_lora(
        self, arrays: StepArrays, spans: list[Span], slots: list[int], bucket: int | None
    ) -> tuple[StepArrays, int]:
        """``arrays`` with the step's rows grouped by adapter, and the tile grid."""
        per_token = np.full(arrays.num_tokens, -1, dtype=np.int32)  # padded rows: base
        counts = [n for _, _, n in spans]
        per_token[: sum(counts)] = np.repeat(np.asarray(slots, dtype=np.int32), counts)
        grid = None if bucket is None else self._lora_grid(bucket)
        order, tiles = plan_tiles(per_token, grid)
        return replace(arrays, lora_order=order, lora_tiles=tiles.ravel()), tiles.shape[1]

    def _batch(
        self, num_tokens: int, num_seqs: int, is_decode: bool, splits: int, max_q_len: int = 1
    ) -> KernelBatch:
        v = self.inputs.view
        return KernelBatch(
            token_ids=v("token_ids", num_tokens),
            positions=v("positions", num_tokens),
            slots=v("slots", num_tokens),
            seq_rows=v("seq_rows", num_seqs),
            ctx_lens=v("ctx_lens", num_seqs),
            q_starts=v("q_starts", num_seqs + 1),
            block_tables=self.rows.table,
            is_decode=is_decode,
            max_q_len=max_q_len,
            num_splits=splits,
            logits_rows=None if is_decode else v("logits_rows", num_seqs),
        )

    def _arrays(
        self, spans: list[Span], tokens: list[int], is_decode: bool, updates: list[int]
    ) -> StepArrays:
        """Host-side inputs of a step; appends the block-table updates to ``updates``."""
        bs, b = self.block_size, len(spans)
        rows = np.fromiter(
            (self.rows.row(seq, seq.block_table, updates) for seq, _, _ in spans),
            dtype=np.int32,
            count=b,
        )
        counts = np.fromiter((n for _, _, n in spans), dtype=np.int32, count=b)
        starts = np.fromiter((start for _, start, _ in spans), dtype=np.int32, count=b)
        q_starts = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(counts, out=q_starts[1:])
        if is_decode:  # one token each: plain Python beats per-sequence numpy calls
            positions = starts
            slots = np.fromiter(
                (seq.block_table[p // bs] * bs + p % bs for seq, p, _ in spans),
                dtype=np.int32,
                count=b,
            )
        else:
            positions = np.concatenate([np.arange(s, s + n, dtype=np.int32) for _, s, n in spans])
            slots = np.concatenate([_slots(seq.block_table, s, n, bs) for seq, s, n in spans])
        return StepArrays(
            token_ids=np.asarray(tokens, dtype=np.int32),
            positions=positions,
            slots=slots,
            seq_rows=rows,
            ctx_lens=starts + counts,
            logits_rows=q_starts[1:] - 1,
            q_starts=q_starts,
        )


def _slots(block_table: list[int], start: int, n: int, bs: int) -> np.ndarray:
    """Pool slots (block * bs + offset) of positions [start, start + n), int32."""
    first = start // bs
    blocks = np.asarray(block_table[first : (start + n - 1) // bs + 1], dtype=np.int32)
    p = np.arange(start, start + n, dtype=np.int32)
    return blocks[p // bs - first] * bs + p % bs
