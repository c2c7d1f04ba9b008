"""Where pdserve keeps what it computes once per machine (converted models, grammar
vocabularies, kernel crossovers). Imports nothing heavy: the frontend uses it too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """``name`` under pdserve's cache: ``$PDSERVE_CACHE``, else ``$XDG_CACHE_HOME/pdserve``,
    else ``~/.cache/pdserve``."""
    root = os.environ.get("PDSERVE_CACHE")
    if root:
        return Path(root) / name
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve" / name
