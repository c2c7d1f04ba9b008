"""Tier 3: one file per block in a local directory, found again by name after a restart.

    <dir>/<namespace hex>/<key hex[:2]>/<key hex>.kvb     a block
    <dir>/quarantine/                                    files that failed a check on load

A file is a header, the block's token ids, then the payload:
    magic "PDKVBLK\\0", format u32, header bytes u32, namespace 16B, key 16B, parent 16B,
    token count u32, payload bytes u64, crc32 of the payload u32, crc32 of the above u32
It is written to a temp file in the same directory and renamed into place, so a reader
sees a whole block or none, and several writers of one block leave one intact file.

Nothing read back is trusted: a file whose magic, format, namespace, key, parent, token
ids, length or checksum disagrees with what the lookup expects is a miss, is moved to
``quarantine/`` (the newest few are kept for a post-mortem), logged and counted. Reads
happen in every worker; writes, the budget and eviction belong to one writer per host
(``persister.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from pathlib import Path

import numpy as np
from isal.isal_zlib import crc32  # zlib's crc32, ~10x faster: the read path's largest cost

logger = logging.getLogger(__name__)

MAGIC = b"PDKVBLK\0"
FORMAT = 1
_HEAD = struct.Struct("<8sII16s16s16sIQI")  # ... up to the payload's crc32
_HEAD_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
_KEEP_QUARANTINED = 32


class BadBlock(Exception):
    """A file that must not be used: why, for the log line."""


def encode_header(
    namespace: bytes, key: bytes, parent: bytes, tokens: np.ndarray, payload: np.ndarray
) -> bytes:
    head = _HEAD.pack(
        MAGIC,
        FORMAT,
        HEADER_BYTES,
        namespace,
        key,
        parent,
        len(tokens),
        payload.nbytes,
        crc32(payload.data),
    )
    return head + _HEAD_CRC.pack(crc32(head)) + tokens.astype("<u4").tobytes()


class DiskStore:
    """Reads (any worker) and writes (the persister) of one namespace's block files."""

    def __init__(self, root: Path, namespace: bytes, block_size: int, payload_nbytes: int) -> None:
        self.root = root
        self.namespace = namespace
        self.dir = root / namespace.hex()
        self.block_size = block_size
        self.payload_nbytes = payload_nbytes
        self.file_nbytes = HEADER_BYTES + 4 * block_size + payload_nbytes
        self.quarantined = 0  # files this process moved aside
        self._lock = threading.Lock()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    # ---- reads ---------------------------------------------------------------------

    def read(self, key: bytes, parent: bytes, tokens: np.ndarray, out: np.ndarray) -> bool:
        """Fill ``out`` (u8, ``payload_nbytes``) with the block ``key`` if its file passes
        every check; False on a miss. A bad file is quarantined (``quarantined`` counts it).

        Four syscalls a block (open, one readv of header and payload straight into
        ``out`` and of one byte past the expected end, futimens, close): no buffered
        reader, no intermediate copy. Thread-safe.
        """
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as e:
            self.quarantine(path, str(e))
            return False
        try:
            self._check(fd, key, parent, tokens, out)
            with contextlib.suppress(OSError):  # most recently used: the writer's LRU is by mtime
                os.utime(fd)
        except (BadBlock, OSError) as e:
            self.quarantine(path, str(e))
            return False
        finally:
            os.close(fd)
        return True

    def _check(
        self, fd: int, key: bytes, parent: bytes, tokens: np.ndarray, out: np.ndarray
    ) -> None:
        raw = bytearray(HEADER_BYTES + 4 * self.block_size)
        past = bytearray(1)  # filled only by a file longer than a block's
        got = os.readv(fd, [raw, out.data, past])
        if got < len(raw):
            raise BadBlock(f"truncated header ({got} bytes)")
        head = raw[: _HEAD.size]
        magic, fmt, hlen, ns, k, par, ntok, plen, crc = _HEAD.unpack(head)
        if magic != MAGIC or fmt != FORMAT or hlen != HEADER_BYTES:
            raise BadBlock("bad magic or format")
        if _HEAD_CRC.unpack(raw[_HEAD.size : HEADER_BYTES])[0] != crc32(head):
            raise BadBlock("header checksum mismatch")
        if ns != self.namespace:
            raise BadBlock("another namespace (model, dtype, block size or layout)")
        if k != key or par != parent:
            raise BadBlock("key or parent mismatch")
        if ntok != self.block_size or plen != self.payload_nbytes:
            raise BadBlock(
                f"{ntok} tokens of {plen} bytes, expected {self.block_size} "
                f"of {self.payload_nbytes}"
            )
        if raw[HEADER_BYTES:] != tokens.astype("<u4", copy=False).tobytes():
            raise BadBlock("token ids differ from the prefix looked up")
        if got != self.file_nbytes:
            raise BadBlock(f"a file of {got} bytes or more, expected {self.file_nbytes}")
        if crc32(out.data) != crc:
            raise BadBlock("payload checksum mismatch")

    def quarantine(self, path: Path, why: str) -> None:
        qdir = self.root / QUARANTINE
        with self._lock:  # readers run on several threads (tiered.py's loads)
            self.quarantined += 1
        logger.warning("KV block file %s failed its check (%s): moved to %s", path, why, qdir)
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            os.replace(path, qdir / f"{path.name}.{os.getpid()}")
            kept = sorted(qdir.iterdir(), key=lambda p: p.stat().st_mtime)
            for old in kept[:-_KEEP_QUARANTINED]:
                old.unlink(missing_ok=True)
        except OSError as e:  # gone already (another reader moved it), or a read-only disk
            logger.warning("could not quarantine %s: %s", path, e)

    # ---- writes (the persister) ----------------------------------------------------

    def write(self, key: bytes, parent: bytes, tokens: np.ndarray, payload: np.ndarray) -> int:
        """Write one block atomically; its bytes on disk (0 if it was there already).

        Raises OSError (disk full, read-only ...) with no temp file left behind.
        """
        path = self.path(key)
        if path.exists():
            return 0
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            with tmp.open("wb") as f:
                f.write(encode_header(self.namespace, key, parent, tokens, payload))
                f.write(payload.data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self.file_nbytes
