"""One copy of a model's read-only weights per host, mapped by every CPU engine worker.

Who does what:
* the launcher creates one empty memfd (``weights_segment.create_segment``) before it
  spawns anything, keeps it open for the server's life and hands its fd to every CPU
  engine worker (``EngineConfig.weights_fd``), restarted ones included. A memfd has no
  name: SIGKILL of the whole tree frees it and leaves nothing in /dev/shm;
* each worker calls ``load_shared`` under a POSIX lock on that fd. The first finds the
  segment empty: it loads the checkpoint as a private worker would, writes what its
  kernels hold (``engine/checkpoint/image.py``) into the segment, seals it read-only, and
  then serves from the mapping like the rest. The others, and a worker restarted later,
  find it sealed, check its digest and map it: no checkpoint read, no packing, no copy.
  A builder killed mid-way leaves no seal, so the next worker builds again.

Segment layout: a header page (magic, layout version, digest of everything that changes
the bytes, where the manifest lies), the tensors at 64-byte aligned offsets, then the
manifest (JSON: each tensor's dtype, shape and offset, and the kernels' description).
Tensors are ``torch.frombuffer`` views of one read-only ``MAP_SHARED`` mapping, so every
worker's page tables point at the same pages and a page counts once in the tree's PSS.

The many-rows GEMM (``engine/weights/gemm.py``) is shared as an ordinary tensor: the kernel
library's VNNI-packed bfloat16 weight where its AVX-512 BF16 build loads, else the plain
weight. Not oneDNN's prepacked one: that is an opaque oneDNN tensor with no storage
(``data_ptr`` and ``untyped_storage`` raise), and nothing in torch builds one over given
memory. On a 2-core AMD EPYC (AVX-512 BF16, no AMX) the VNNI-packed GEMM is as fast as a
prepacked copy in every worker (faster at 1-64 rows, within 3 % at 256; the figures are in
``engine/weights/gemm.py``) at none of its cost: 212 MB of private memory per worker.
Where the library does not load, sharing keeps the plain weight (1.2-1.4x slower than
prepacked at 1-64 rows); ``--no-share-weights`` keeps private prepacked copies there.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import logging
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import image
from engine.checkpoint.loader import load_weights, release_freed_memory
from engine.checkpoint.weights_segment import SharedWeightsError
from engine.config import EngineConfig
from engine.model.causal_lm import CausalLM
from engine.weights import int4_tiles
from engine.weights.gemm import vnni_supported
from engine.weights.plan import gguf_source

logger = logging.getLogger(__name__)

_MAGIC = b"PDSWGT01"
_HEADER = struct.Struct("<8sI32sQQ")  # magic, layout version, digest, manifest offset, length
_DATA_START = 4096
_ALIGN = 64
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def weights_digest(model_dir: Path, quantization: str, dtype: torch.dtype, gemm: str) -> str:
    """32 hex digits over everything that changes the image's bytes: the checkpoint (and
    the GGUF it is served from), the resolved quantization, the activation dtype, the GEMM
    copies (``gemm``: whether held and from how many rows), torch and the CPU kernels it
    picks, the int4 kernel (each packs its own layout), and this image's layout version."""
    from engine.kv.tiers.keys import weights_fingerprint

    source = gguf_source(model_dir) if quantization == "gguf" else None
    text = "|".join(
        (
            f"layout {image.LAYOUT_VERSION}",
            weights_fingerprint(model_dir, () if source is None else (source,)),
            quantization,
            str(dtype),
            gemm,
            torch.__version__,
            torch.backends.cpu.get_cpu_capability(),
            f"int4 {int4_tiles.kernel_name()}",
        )
    )
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@contextmanager
def _locked(fd: int) -> Iterator[None]:
    # NOTE: a POSIX record lock, owned per process: the workers inherit one open file
    # description, which flock() would treat as a single owner. A killed holder's lock
    # is released by the kernel.
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


def load_shared(model: CausalLM, fd: int, digest: str, load_private: Callable[[], None]) -> bool:
    """Fill ``model`` from the weights segment ``fd``; False if its weights stay private.

    ``load_private()`` fills ``model`` from the checkpoint (the builder's path); the
    image's GEMM weights must be ordinary tensors (``load_weights(shareable=True)``). Raises
    ``SharedWeightsError``, ``model`` untouched, when the segment holds another image.
    """
    with _locked(fd):
        built = False
        if not _sealed(fd):
            load_private()
            meta, tensors = image.export(model)
            try:
                _write(fd, digest, meta, tensors)
            except SharedWeightsError as e:
                logger.warning("weights stay private to this worker: %s", e)
                return False
            del meta, tensors
            built = True
        meta, views, mapping = _map(fd, digest)
    image.bind(model, meta, views)
    if built:  # the private copies the builder loaded are garbage now
        gc.collect()
        release_freed_memory()
    logger.info(
        "weights %s the host's shared segment: %.1f MiB, %d tensors",
        "written to" if built else "mapped from",
        len(mapping) / (1 << 20),
        len(views),
    )
    return True


def _sealed(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE)


def _write(fd: int, digest: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Lay out, write and seal the image; equal storage (tied rows) is written once."""
    entries: dict[str, list[Any]] = {}
    placed: dict[tuple[int, int, str, tuple[int, ...]], int] = {}
    chunks: list[tuple[int, torch.Tensor]] = []
    end = _DATA_START
    for name in sorted(tensors):
        t = tensors[name]
        key = (t.data_ptr(), t.numel(), str(t.dtype), tuple(t.shape))
        if key not in placed:
            end = -(-end // _ALIGN) * _ALIGN
            placed[key] = end
            chunks.append((end, t))
            end += t.numel() * t.element_size()
        entries[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), placed[key]]
    manifest = json.dumps({"digest": digest, "tensors": entries, "kernels": meta}).encode()
    total = end + len(manifest)
    try:
        os.ftruncate(fd, 0)  # whatever a killed builder left
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        raise SharedWeightsError(f"cannot reserve {total >> 20} MiB of shared memory: {e}") from e
    for offset, t in chunks:
        _pwrite_all(fd, t.reshape(-1).view(torch.uint8).numpy().data, offset)
    _pwrite_all(fd, memoryview(manifest), end)
    header = _HEADER.pack(_MAGIC, image.LAYOUT_VERSION, digest.encode(), end, len(manifest))
    _pwrite_all(fd, memoryview(header), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _map(fd: int, digest: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], mmap.mmap]:
    """The sealed image's kernel description and its tensors, views of one mapping."""
    size = os.fstat(fd).st_size
    magic, version, found, offset, length = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
    if magic != _MAGIC or version != image.LAYOUT_VERSION:
        raise SharedWeightsError(f"the weights segment holds no image of layout {version}")
    if found.decode() != digest:
        raise SharedWeightsError(
            f"the host's weights segment holds image {found.decode()}, this worker needs "
            f"{digest} (another checkpoint, quantization, dtype or GEMM setting)"
        )
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    manifest = json.loads(mapping[offset : offset + length])
    views = {}
    with warnings.catch_warnings():
        # NOTE: the mapping is read-only on purpose (the segment is sealed, and no kernel
        # writes its weights); torch warns that it cannot make such a buffer writable.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, (dtype_name, shape, at) in manifest["tensors"].items():
            dtype = getattr(torch, dtype_name)
            numel = 1
            for dim in shape:
                numel *= dim
            if numel == 0:
                views[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=at)
            views[name] = flat.view(shape)
    return manifest["kernels"], views, mapping


def load_model(
    build: Callable[[], CausalLM], config: EngineConfig, quantization: str, dtype: torch.dtype
) -> CausalLM:
    """``build()``'s model with its weights: mapped from the host's shared segment where
    ``config`` names one (CPU), else loaded from the checkpoint into this process (also
    when the segment cannot be used: logged, and served privately)."""
    model = build()
    gemm_rows = config.gemm_min_rows if config.large_batch_gemm else None
    inputs = "bfloat16"
    if gemm_rows is not None and quantization != "none":
        inputs = int4_tiles.gemm_inputs(config.gemm_inputs)
    root = Path(config.model)
    if config.weights_fd is None or torch.device(config.device).type != "cpu":
        load_weights(model, root, quantization, gemm_rows, gemm_inputs=inputs)
        return model
    gemm = "no gemm"
    if gemm_rows is not None:
        layout = "vnni" if vnni_supported() else "plain"
        if inputs == "int8":
            layout = "a8"  # on the packed layers' own tiles (``int4_tiles.A8Gemm``)
        elif int4_tiles.kernel_name() == "amx":
            layout = "tiles"  # the packed layers' own (``int4_tiles.TilesGemm``)
        gemm = f"gemm from {gemm_rows}, {layout}"
    digest = weights_digest(root, quantization, dtype, gemm)
    try:
        load_shared(
            model,
            config.weights_fd,
            digest,
            lambda: load_weights(
                model, root, quantization, gemm_rows, shareable=True, gemm_inputs=inputs
            ),
        )
        return model
    except (SharedWeightsError, image.WeightsImageError) as e:
        logger.error("weights not shared, loading a private copy: %s", e)
    model = build()
    load_weights(model, root, quantization, gemm_rows, gemm_inputs=inputs)
    return model
