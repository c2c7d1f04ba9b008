"""Every child of a server is forked from the zygote (``runtime/zygote.py``) by default:
its anonymous pages (torch's relocated data, the imported modules) are shared with the
zygote and its siblings rather than its own, its parent is the launcher, and a restarted
worker is forked again. ``--no-fork-workers`` starts fresh interpreters, which share none
of those pages. Both serve transformers' greedy output."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.harness.processes import process_tree
from bundled_models import tiny
from tests.conftest import LaunchedServer
from tests.e2e.helpers import (
    check_greedy_matches_transformers,
    children,
    pid_of,
    random_prompts,
    title,
    wait_all_alive,
)

ARGS = "--prefill 1 --decode 1 --detokenizers 1 --device cpu --max-model-len 512"
CHILDREN = ("pdserve:prefill-0", "pdserve:decode-0", "pdserve:detok-0", "pdserve:frontend-0")
# A forked child shares about 150 MiB of anonymous pages with the zygote (on CPU torch's
# relocated data alone is ~130 MiB); a fresh interpreter shares none.
FORKED_MIB = 60
FRESH_MIB = 8


def shared_anon_mib(pid: int) -> float:
    """Anonymous pages ``pid`` shares with other processes: resident minus its share."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1])
    return (fields["Anonymous"] - fields["Pss_Anon"]) / 1024


def serving(extra: str = "") -> Iterator[LaunchedServer]:
    srv = LaunchedServer(shlex.split(f"{ARGS} {extra}"))
    srv.wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def forked() -> Iterator[LaunchedServer]:
    yield from serving()


def test_children_are_forked_from_the_zygote_and_share_its_pages(
    forked: LaunchedServer,
) -> None:
    titles = {title(pid): pid for pid in children(forked.proc.pid)}
    # The launcher is every one's parent, and there is one of each.
    assert sorted(title(pid) for pid in children(forked.proc.pid)) == sorted(
        [*CHILDREN, "pdserve:zygote"]
    )
    shared = {name: shared_anon_mib(titles[name]) for name in CHILDREN}
    assert all(mib > FORKED_MIB for mib in shared.values()), shared
    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    check_greedy_matches_transformers(forked, model, random_prompts(4, seed=5), 10)


def test_a_restarted_worker_is_forked_again(forked: LaunchedServer) -> None:
    old = pid_of(forked, "pdserve:decode-0")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    new = old
    while new == old and time.monotonic() < deadline:
        time.sleep(0.2)
        with contextlib.suppress(AssertionError):
            new = pid_of(forked, "pdserve:decode-0")
    assert new != old, "decode-0 was not restarted"
    wait_all_alive(forked)
    assert shared_anon_mib(new) > FORKED_MIB
    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    check_greedy_matches_transformers(forked, model, random_prompts(3, seed=6), 8)


def test_a_stop_ends_every_child_and_the_zygote() -> None:
    srv = LaunchedServer(shlex.split(ARGS))
    srv.wait_ready()
    tree = process_tree(srv.proc.pid)
    assert srv.stop() == 0
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in tree if Path(f"/proc/{pid}").exists()]


def test_without_forking_each_child_is_a_fresh_interpreter() -> None:
    for srv in serving("--no-fork-workers"):
        titles = {title(pid): pid for pid in children(srv.proc.pid)}
        assert sorted(title(pid) for pid in children(srv.proc.pid)) == sorted(CHILDREN)
        shared = {name: shared_anon_mib(titles[name]) for name in CHILDREN}
        assert all(mib < FRESH_MIB for mib in shared.values()), shared
        model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
        check_greedy_matches_transformers(srv, model, random_prompts(4, seed=5), 10)
