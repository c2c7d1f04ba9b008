"""How the supervisor reports a child that died: a SIGKILL names the OOM killer."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest

from launcher.supervisor import Child, ChildFailed, Supervisor, describe_exit
from pdserve.process import ProcessSpec
from router.load_table import LoadTable


def test_exit_codes_in_words() -> None:
    assert describe_exit(1) == "code 1"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert "OOM killer" in describe_exit(-9) and "--kv-cache-tokens" in describe_exit(-9)


def test_a_child_sigkilled_during_startup_may_have_been_the_oom_killer() -> None:
    child = Child(ProcessSpec(role="decode", index=0, doorbell_fd=-1), env={})
    # What the OOM killer does to a worker that touches more memory than there is.
    child.proc = subprocess.Popen([sys.executable, "-c",
                                   "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])  # fmt: skip
    child.pidfd = os.pidfd_open(child.proc.pid)
    child.proc.wait()
    table = LoadTable(mmap.mmap(-1, LoadTable.layout_nbytes(1)), 1)
    with pytest.raises(ChildFailed, match="decode-0 exited during startup") as e:
        Supervisor([child], table, 0).wait_ready(5, lambda: False)
    assert "killed by SIGKILL, possibly by the kernel's OOM killer" in str(e.value)
