"""The documents a newcomer reads hold: every link in README.md and docs/ names a file that
exists, and every ``python -m benchmarks...`` command they name runs (``--help``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# A markdown link's target: [text](target), without a scheme (no http:, mailto:).
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_BENCHMARK = re.compile(r"python -m (benchmarks(?:\.[a-z_]+)+)")


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _links(doc: Path) -> list[str]:
    return [t for t in _LINK.findall(doc.read_text()) if not re.match(r"^[a-z]+:", t)]


def test_the_readme_is_an_entry_page() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move depth to docs/"


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_to_a_file(doc: Path) -> None:
    missing = []
    for target in _links(doc):
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(REPO)} links to files that do not exist: {missing}"


def test_the_readme_links_to_every_docs_page() -> None:
    linked = {(REPO / t.split("#", 1)[0]).resolve() for t in _links(REPO / "README.md")}
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def _benchmark_commands() -> list[str]:
    docs = [*_documents(), REPO / "benchmarks" / "README.md"]
    return sorted({m for doc in docs for m in _BENCHMARK.findall(doc.read_text())})


def test_the_documents_name_benchmarks() -> None:
    assert len(_benchmark_commands()) > 10, "no benchmark commands found: is the pattern stale?"


def test_every_benchmark_command_named_runs() -> None:
    """One interpreter per module, as a user would run it: an import error, a moved module
    or a broken argument parser fails here, not in front of a user."""
    failed = []
    for module in _benchmark_commands():
        run = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if run.returncode != 0:
            failed.append(f"{module}: exit {run.returncode}: {run.stderr.strip()[-300:]}")
    assert not failed, "\n".join(failed)
