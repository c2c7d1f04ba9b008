"""Read a GGUF file's header: metadata and tensor table, with tensor data left memory-mapped.

Layout (little-endian, GGUF v2/v3): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry is key (u64 length + UTF-8), value type u32, value; then per
tensor: name, n_dims u32, dims u64 x n_dims (innermost first), ggml type u32, offset u64
from the data section, which starts at the next ``general.alignment`` (default 32) boundary.

Why not ``gguf.GGUFReader``: it builds numpy views for every element of every metadata
array, ~5 s for a 49k-token vocabulary and ~15 s for Qwen2's 152k on a busy 2-core host.
The converter needs no array but per-layer sizes (the tokenizer is rebuilt by transformers),
so string arrays are skipped here and kept as their length; numeric arrays are read whole.
De-quantization is the ``gguf`` package's (``gguf.quants.dequantize``), on views made here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf import GGMLQuantizationType as Q
from gguf.quants import quant_shape_to_byte_shape

# Metadata value types (GGUFValueType): fixed-size scalars, 8 = string, 9 = array.
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_PLAIN = {Q.F32: np.float32, Q.F16: np.float16}  # stored as values; the rest as bytes


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: Q
    shape: tuple[int, ...]  # torch order (outermost first)
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int


class StringArray(int):
    """A skipped array of strings: only its length is kept."""


class GGUFHeader:
    """``metadata`` (key -> value) and ``tensors`` (name -> TensorInfo) of one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._pos = 0
        if self._read("<I") != GGUF_MAGIC:
            raise ValueError("no GGUF magic number")
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; readable: 2, 3")
        n_tensors, n_meta = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_meta):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = {
            name: TensorInfo(name, q, shape, start + off, _nbytes(q, shape))
            for name, q, shape, off in infos
        }
        for t in self.tensors.values():
            if t.offset + t.nbytes > len(self._map):
                raise ValueError(f"tensor {t.name} runs past the end of the file")

    def data(self, t: TensorInfo) -> np.ndarray:
        """The stored tensor: values for F32/F16, (rows, bytes per row) uint8 for the rest.

        This is the layout ``gguf.quants.dequantize`` takes; a view of the memory map.
        """
        raw = self._map[t.offset : t.offset + t.nbytes]
        if t.qtype in _PLAIN:
            return raw.view(_PLAIN[t.qtype]).reshape(t.shape)
        return raw.reshape(quant_shape_to_byte_shape(t.shape, t.qtype))

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._read(_SCALAR[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF metadata type {vtype}")
        etype, count = self._read("<I"), self._read("<Q")
        if etype == _STRING:  # walk the lengths, keep nothing (vocabularies, merges)
            for _ in range(count):
                n = self._read("<Q")  # NOTE: not `_pos += _read()`: that adds to the old _pos
                self._pos += n
            return StringArray(count)
        if etype not in _SCALAR:
            raise ValueError(f"GGUF array of type {etype} is not readable here")
        dtype = np.dtype(_SCALAR[etype])
        out = np.frombuffer(self._buf, dtype, count, self._pos).tolist()
        self._pos += dtype.itemsize * count
        return out

    def _tensor_info(self) -> tuple[str, Q, tuple[int, ...], int]:
        name = self._string()
        dims = [self._read("<Q") for _ in range(self._read("<I"))]
        return name, Q(self._read("<I")), tuple(reversed(dims)), self._read("<Q")


def _nbytes(q: Q, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[q]
    return int(np.prod(shape)) * size // block
