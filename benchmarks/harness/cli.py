"""The command line every benchmark starts from."""

from __future__ import annotations

import argparse
from pathlib import Path


def quick_parser(doc: str | None, smaller: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--quick``: a smoke run that is
    ``smaller`` (what it cuts, e.g. "fewer requests") and writes no results file."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    help_ = f"{smaller} (smoke run; writes no results file)"
    parser.add_argument("--quick", action="store_true", help=help_)
    return parser


def model_parser(doc: str | None, results: Path) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--model`` (default: the embedded
    SmolLM2) and ``--out`` (default: ``results``)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--out", type=Path, default=results)
    return parser
