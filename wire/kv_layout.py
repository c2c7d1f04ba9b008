"""The KV pool's layout: the one statement of its shape, shared by the engine that
allocates a pool and the transport that moves its blocks between pools and hosts.

Shape ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``, block-major:
index 0 of the third axis is K, 1 is V, and one block (every layer's K and V for
``block_size`` tokens) is one contiguous byte range of ``block_nbytes``, so a run of
consecutive block ids is one contiguous range too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from wire.json_spec import JsonSpec

if TYPE_CHECKING:
    import torch

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # the KV dtypes pools may hold
KV_ORDERS = ("tokens", "vec16")


@dataclass(frozen=True, slots=True)
class KVLayout(JsonSpec):
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"  # a key of ITEMSIZE
    # How the bytes inside a block are ordered: "tokens" (the shape above, the torch and
    # Triton backends) or "vec16" (the fused CPU backend's kernel library, its own order in
    # the same bytes). Blocks of different orders are not interchangeable.
    order: str = "tokens"

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        if self.order not in KV_ORDERS:
            raise ValueError(f"KV block order {self.order!r} is not one of {KV_ORDERS}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: wire stays importable without torch

        return getattr(torch, self.dtype)

    @property
    def block_nbytes(self) -> int:
        per_block = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return per_block * ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes
