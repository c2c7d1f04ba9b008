"""A step's rows grouped by LoRA adapter, as the Triton LoRA kernels read them.

Host side, numpy, no triton: ``plan_tiles`` turns each row's adapter slot (-1: the base)
into ``order``, the rows of each adapter next to each other (segments), and a tile table
cutting every segment into tiles of at most ``TILE_ROWS`` rows. One kernel program works
on one tile, so a tile never mixes adapters and base rows are in none: one launch serves
every adapter of the step and skips the base rows.

A decode CUDA graph replays a fixed grid: ``max_tiles`` bounds the tiles of any step of
its size, and ``plan_tiles(..., grid=...)`` pads the table with empty tiles (slot -1)
up to it.
"""

from __future__ import annotations

import numpy as np

TILE_ROWS = 16  # rows per tile: the kernels' tl.dot M dimension (16 at least)


def max_tiles(num_rows: int, num_adapters: int) -> int:
    """Tiles enough for ``num_rows`` rows of at most ``num_adapters`` adapters: each
    segment of n rows takes ceil(n / TILE_ROWS) <= n / TILE_ROWS + 1 tiles."""
    return -(-num_rows // TILE_ROWS) + min(num_rows, num_adapters)


def plan_tiles(row_slots: np.ndarray, grid: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's slot (T,) int, -1 for the base -> (order (T,), tiles (3, M)), int32.

    ``order``: adapter rows sorted by slot (stably: rows of one adapter keep their order),
    then the base rows (in no tile: never read). ``tiles``: per tile its slot, then its
    first and past-the-end index into ``order``. ``grid``: M, padded with slot -1 tiles
    (None: exactly the tiles needed, at least one).
    """
    slots = np.asarray(row_slots, dtype=np.int64)
    adapter_rows = np.flatnonzero(slots >= 0)
    base_rows = np.flatnonzero(slots < 0)
    grouped = adapter_rows[np.argsort(slots[adapter_rows], kind="stable")]
    order = np.concatenate((grouped, base_rows)).astype(np.int32)
    seg_slots, seg_starts, seg_counts = np.unique(
        slots[grouped], return_index=True, return_counts=True
    )
    tiles = []  # (slot, first, past-the-end) per tile
    for slot, start, count in zip(seg_slots.tolist(), seg_starts.tolist(), seg_counts.tolist()):
        end = start + count
        tiles += [(slot, i, min(i + TILE_ROWS, end)) for i in range(start, end, TILE_ROWS)]
    size = max(len(tiles), 1) if grid is None else grid
    assert len(tiles) <= size, f"{len(tiles)} tiles do not fit a grid of {size}"
    table = np.zeros((3, size), dtype=np.int32)
    table[0] = -1
    if tiles:
        table[:, : len(tiles)] = np.asarray(tiles, dtype=np.int32).T
    return order, table
