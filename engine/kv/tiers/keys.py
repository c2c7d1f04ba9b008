"""Names of KV blocks outside the pool: a namespace digest and 128-bit chained keys.

A block's bytes depend on the model weights, the KV dtype, the block size, the pool's
layout and the token prefix (and an adapter salt, the sequence's ``extra``). The
*namespace* digests everything but the tokens; a block's *key* chains the namespace (and
``extra``) with every token of the prefix up to the block's end, so equal keys mean equal
KV, and a store of another model, dtype or block size can never answer a lookup. 128 bits,
not the pool's 64: a key names a file that outlives the process and the model version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wire.kv_layout import KVLayout

# Bump when the pool's block layout (engine/kv/kv_cache.py) changes meaning.
KV_LAYOUT_VERSION = 1
# Bump when the way keys are chained below changes.
HASH_SCHEME = b"pdserve-tierkey-v1"
KEY_BYTES = 16
_SAMPLE = 1 << 16  # bytes read per sample of a weights file
_SAMPLES = 16  # samples per weights file, spread over its length


@dataclass(frozen=True)
class Namespace:
    """Everything but the tokens that changes a block's bytes, digested to 16 bytes."""

    weights: str  # weights_fingerprint() of the checkpoint
    dtype: str  # the pool's dtype, e.g. "torch.float32"
    block_size: int
    layout: str  # the pool's per-block shape, (layers, 2, block_size, kv_heads, head_dim)

    @property
    def digest(self) -> bytes:
        text = f"{self.weights}|{self.dtype}|{self.block_size}|{self.layout}|"
        text += f"{KV_LAYOUT_VERSION}|{HASH_SCHEME.decode()}"
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def block_namespace(weights: str, layout: KVLayout) -> bytes:
    """The namespace digest of the blocks of a pool of ``layout`` (its dtype, block size,
    per-block shape and byte order inside a block) holding KV of ``weights``.

    NOTE: the one statement of a block's namespace. Only the engine workers call it, on
    their own pool's layout (``layout_of(pool, backend.kv_order)``): the order inside a
    block is their attention backend's, which only they know. The first of them publishes
    the digest in tier 2's header (``HostStore.adopt_namespace``), and tier 3's writer and
    the router take it from there, so every party names a block alike.
    """
    per_block = str(layout.shape[1:])
    if layout.order != "tokens":  # "tokens" blocks keep the namespace they always had
        per_block += f" {layout.order}"
    return Namespace(weights, f"torch.{layout.dtype}", layout.block_size, per_block).digest


def weights_fingerprint(model_dir: Path, also: Sequence[Path] = ()) -> str:
    """A digest of a checkpoint's weights: config, every weights file's size and header,
    and samples of its bytes spread over the whole file; ``also``: more files to sample
    (the GGUF a converted checkpoint is served from).

    NOTE: sampled, not a full read (a checkpoint may be many GB): two fine-tunes of one
    base differ in nearly every tensor, so they differ in the samples too.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.gguf"))
    for path in [model_dir / "config.json", *files, *also]:
        if not path.exists():
            continue
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def root_key(namespace: bytes, extra: bytes | None) -> bytes:
    """The parent key of a sequence's first block: the namespace, salted by ``extra``."""
    return hashlib.blake2b(
        namespace + (extra or b""), digest_size=KEY_BYTES, person=b"pdserve-tierroot"
    ).digest()


def chain_keys(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of every full block of ``token_ids``, chained from ``parent``."""
    n = len(token_ids) // block_size
    raw = memoryview(np.asarray(token_ids[: n * block_size], dtype="<u4").tobytes())
    step, out, key = 4 * block_size, [], parent
    for i in range(n):
        b = hashlib.blake2b(key, digest_size=KEY_BYTES, person=b"pdserve-tierblk")
        b.update(raw[i * step : (i + 1) * step])
        key = b.digest()
        out.append(key)
    return out
