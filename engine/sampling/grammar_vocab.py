"""The vocabulary as xgrammar sees it (``TokenizerInfo``), built once per model and cached.

Building it means loading the Hugging Face tokenizer and decoding every token: seconds
on a small CPU, in every process that constrains output (the frontend that validates,
each prefill and decode worker). Its serialised form loads in a fraction of that, so the
first process to build it writes it to disk (atomically) and the others read it.

The cache lives under ``$PDSERVE_CACHE`` (else ``$XDG_CACHE_HOME/pdserve``, else
``~/.cache/pdserve``) in ``xgrammar/``, named by a hash of what determines the result:
the tokenizer files' paths, sizes and mtimes, the vocabulary size, the stop tokens and
the xgrammar version. A cache that cannot be read or written is only a slower start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from engine.cache import cache_dir

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
)


def _cache_file(model_dir: str, vocab_size: int, stop_ids: Sequence[int] | None) -> Path | None:
    root = Path(model_dir)
    if not root.is_dir():
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{root.resolve()}|{vocab_size}|{list(stop_ids or [])}|".encode())
    h.update(version("xgrammar").encode())
    for name in _TOKENIZER_FILES:
        path = root / name
        if path.exists():
            st = path.stat()
            h.update(f"|{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir("xgrammar") / f"{h.hexdigest()}.json"


def tokenizer_info(
    load_tokenizer: Callable[[], Any],
    vocab_size: int,
    stop_ids: Sequence[int] | None,
    model_dir: str | None,
) -> Any:
    """The ``xgrammar.TokenizerInfo`` of a model, from the disk cache when it is there."""
    import xgrammar as xgr

    path = _cache_file(model_dir, vocab_size, stop_ids) if model_dir else None
    if path is not None and path.exists():
        try:
            return xgr.TokenizerInfo.deserialize_json(path.read_text())
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("ignoring the unreadable grammar vocabulary cache %s: %s", path, e)
    info = xgr.TokenizerInfo.from_huggingface(
        load_tokenizer(), vocab_size=vocab_size, stop_token_ids=list(stop_ids) if stop_ids else None
    )
    if path is not None:
        _write_atomically(path, info.serialize_json())
    return info


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except OSError as e:
        logger.warning("cannot cache the grammar vocabulary at %s: %s", path, e)
