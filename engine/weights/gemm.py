"""The many-rows path of a packed linear layer: its de-quantized weights in bfloat16, and the
row count from which that GEMM beats the packed kernel, measured on this machine.

torch's int4 CPU kernel de-quantizes per block of rows, so its cost grows with every row;
a bfloat16 GEMM is bound by reading its weights until far more rows. SmolLM2's linear
layers of one step (30 layers, 2 threads, a 2-core AMD EPYC Zen 4 with AVX-512 BF16, no
AMX; ``python -m benchmarks.engine.linear_kernels``, ``benchmarks/results/linear_kernels.md``),
ms:

    rows                              1      8     32     64    256
    packed int4                     4.2    6.9   24.6   45.1  177.7
    bf16, plain F.linear           20.7   21.9   32.8   51.6  149.3
    bf16, prepacked for oneDNN     15.7   15.0   25.6   42.6  136.9
    bf16, VNNI-packed (library)     9.8   10.5   22.0   37.7  133.5

So the packed kernel serves a few rows and the GEMM the rest; where they cross depends on
the CPU (AMX moves it down, AVX2 up), the shape and the threads, so ``min_gemm_rows``
measures it per weight shape at load, each pass from memory as in a step (``_cache_flush``),
once per machine (the first worker measures, the others read its answer), and caches it.

Where the packed layers run the AMX int4 kernel, their many-rows GEMM is none of these but
``TilesGemm`` (``engine/weights/int4_tiles.py``), which de-quantizes their own int4 tiles to
bfloat16 once per call: no copy of the weights, and as fast as the library's GEMM on its
bfloat16 copy at 256 rows, faster below (``benchmarks/results/linear_kernels.md``).
Elsewhere, three GEMMs, one interface (``x (T, K) -> (T, N)`` in ``out_dtype``, by default
the input's), chosen by ``bf16_gemm`` in this order:
* ``VnniGemm``: the kernel library's bfloat16 GEMM (``engine/kernels/vllm_cpu.py``; its
  AVX-512 BF16 build) on the weight reordered once into pairs along K. The reordered
  weight is an ordinary tensor of the weight's shape, so it can live in the host's shared
  weights segment (``engine/checkpoint/image.py``); here it is as fast as oneDNN's
  prepacked weight (faster at 1-64 rows, 3 % slower at 256) and shareable;
* ``PrepackedGemm``: the weight reordered once into oneDNN's blocked layout, the route
  inductor's CPU weight freezing takes (``torch.ops.mkldnn``); where this torch's oneDNN
  computes bfloat16 and the weight stays private (an opaque tensor, no storage to share);
* ``PlainGemm``: ``F.linear`` on the contiguous weight: the torch-only path, for any other
  CPU, and what the tests check the others against.

All three compute in float32 inside and round each output once to bfloat16; they may
differ from each other in that last bit, and each gives a row the same bits whatever the
rows beside it and the threads (``tests/engine/test_gemm.py``): a prompt's KV does not
depend on how it was batched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache import cache_dir
from engine.direct_attrs import DirectAttrs
from engine.kernels import vllm_cpu

logger = logging.getLogger(__name__)

# Row counts tried, in order; the GEMM takes over at the first where it is faster and stays
# faster at the next one (a single noisy win does not move the crossover).
_CANDIDATES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
NEVER = 1 << 30  # the packed kernel serves every batch
_REPEATS = 7
# Bump when the measurement or the packed kernel changes, so cached crossovers are
# measured again (4: the few-rows kernel streams one tile at a time).
_VERSION = 4


def prepacked_supported() -> bool:
    """Whether this torch's oneDNN computes bfloat16 GEMMs on this CPU."""
    return bool(torch.backends.mkldnn.is_available()) and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PlainGemm(DirectAttrs):
    """``F.linear`` on an (N, K) bfloat16 weight: the torch-only path."""

    compute_dtype = torch.bfloat16  # what forward(x, None) would cast from, as every GEMM here

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous(), persistent=False)
        self.weight: torch.Tensor

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(out_dtype or x.dtype)


class PrepackedGemm(DirectAttrs):
    """An (N, K) bfloat16 weight reordered once for oneDNN's GEMM.

    NOTE: the reordered weight is an opaque oneDNN tensor, private to this process (it has
    no storage to map from shared memory).
    """

    compute_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.to(torch.bfloat16).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
        return y.to(out_dtype or x.dtype)


def vnni_supported() -> bool:
    """Whether the kernel library's bfloat16 GEMM loads here (its AVX-512 BF16 build)."""
    return vllm_cpu.available() is not None and hasattr(torch.ops._C, "weight_packed_linear")


class VnniGemm(DirectAttrs):
    """An (N, K) bfloat16 weight reordered once into the library's VNNI layout (pairs of
    inputs side by side, what its dot-product instructions read); same shape and dtype."""

    compute_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, packed: bool = False) -> None:
        """``packed``: ``weight`` is in the layout already (bound from an image)."""
        super().__init__()
        if not packed:
            # Raises RuntimeError for shapes the kernel does not tile (N or K not a
            # multiple of its blocks): ``bf16_gemm`` then takes another GEMM.
            weight = torch.ops._C.convert_weight_packed(weight.to(torch.bfloat16).contiguous())
        self.register_buffer("weight", weight, persistent=False)
        self.weight: torch.Tensor
        self._op = torch.ops._C.weight_packed_linear

    @classmethod
    def from_packed(cls, packed: torch.Tensor) -> VnniGemm:
        """A GEMM over a weight already in its layout (``engine/checkpoint/image.py``)."""
        return cls(packed, packed=True)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.empty(xb.shape[0], self.weight.shape[0], dtype=torch.bfloat16)
        self._op(y, xb, self.weight, None, True)
        return y.to(out_dtype or x.dtype)


def bf16_gemm(weight: torch.Tensor, shareable: bool = False) -> nn.Module:
    """The fastest bfloat16 GEMM this CPU runs for ``weight`` (N, K); ``shareable``: one
    whose weight is an ordinary tensor, to be placed in shared memory (not prepacked)."""
    if vnni_supported():
        try:
            return VnniGemm(weight)
        except RuntimeError as e:
            logger.info("a %s weight takes torch's GEMM: %s", tuple(weight.shape), e)
    if not shareable and prepacked_supported():
        return PrepackedGemm(weight)
    return PlainGemm(weight)


def min_gemm_rows(
    packed: Callable[[torch.Tensor], object],
    gemm: Callable[[torch.Tensor], object],
    shape: tuple[int, int],
    tag: str,
) -> int:
    """Rows from which ``gemm`` is faster than ``packed`` for an (N, K) ``shape`` weight.

    ``tag`` names the pair of kernels (it keys the cache beside the shape). Cached per
    machine (CPU model and flags, torch, cores), so every worker of a host and every
    restart uses the same crossover without measuring again.
    """
    path = cache_dir("kernels") / f"{_cache_key(tag, shape)}.json"
    cached = _read(path)
    if cached is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (held across the measure)
    except OSError as e:
        logger.warning("cannot cache the GEMM crossover in %s (%s): measuring here", path, e)
        return _measure(packed, gemm, shape[1])
    with lock:
        # NOTE: one measurement per machine: the workers of a host start together, and two
        # measurements could disagree, giving one prompt's rows other kernels in another
        # worker. The first to take the lock measures; the rest read its answer.
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read(path)
        if cached is not None:
            return cached
        rows = _measure(packed, gemm, shape[1])
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"min_rows": rows, "shape": list(shape), "tag": tag}))
            tmp.replace(path)
        except OSError as e:
            logger.warning("could not cache the GEMM crossover in %s: %s", path, e)
    return rows


def _read(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["min_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _measure(
    packed: Callable[[torch.Tensor], object],
    gemm: Callable[[torch.Tensor], object],
    in_features: int,
) -> int:
    gen = torch.Generator().manual_seed(0)
    wins = [False] * len(_CANDIDATES)
    threads = torch.get_num_threads()
    # Measured on every core this process may use, whatever its share of them now: the
    # answer is the machine's, shared by all its workers (the cache key has no threads).
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    flush = _cache_flush()
    try:
        for i, m in enumerate(_CANDIDATES):
            x = torch.randn(m, in_features, generator=gen).to(torch.bfloat16)
            wins[i] = _best(gemm, x, flush) < _best(packed, x, flush)
            if i and wins[i] and wins[i - 1]:
                return _CANDIDATES[i - 1]
        return NEVER
    finally:
        torch.set_num_threads(threads)


def _best(fn: Callable[[torch.Tensor], object], x: torch.Tensor, flush: torch.Tensor) -> float:
    fn(x)  # warm: first calls allocate
    best = float("inf")
    for _ in range(_REPEATS):
        flush.view(torch.int64).sum()  # untimed: the weights leave the caches
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best


def _cache_flush() -> torch.Tensor:
    """A buffer twice the last-level cache, read before each timed pass.

    NOTE: a step reads the whole model's weights between two calls of one layer, so each
    call finds its weights in memory, not cache. Timed back to back, one shape's layers
    stay in a large L3 (30 of SmolLM2's o projections in bfloat16 are 20 MB), which
    favours the GEMM, whose weights are 4x the packed bytes: on a Zen 4 with 32 MB of L3,
    the o projection's GEMM won from 2 rows here, and lost to the packed kernel up to 16
    rows in a step (``benchmarks/results/linear_kernels.md``).
    """
    size = 64 << 20
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        if text.endswith("K"):
            size = min(max(2 * (int(text[:-1]) << 10), 8 << 20), 512 << 20)
    except (OSError, ValueError):
        pass
    return torch.ones(size, dtype=torch.uint8)  # written: zero pages would share one frame


def _cache_key(tag: str, shape: tuple[int, int]) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(f"v{_VERSION}|{tag}|{shape}|{torch.__version__}|{os.cpu_count()}".encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()


def _cpu_identity() -> str:
    """The CPU's model name and flags: what decides which kernel is fastest."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
