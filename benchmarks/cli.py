"""The command line every benchmark starts from."""

from __future__ import annotations

import argparse


def quick_parser(doc: str | None, smaller: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--quick``: a smoke run that is
    ``smaller`` (what it cuts, e.g. "fewer requests") and writes no results file."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    help_ = f"{smaller} (smoke run; writes no results file)"
    parser.add_argument("--quick", action="store_true", help=help_)
    return parser
