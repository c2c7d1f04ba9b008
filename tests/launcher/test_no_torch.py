"""The launcher plans, creates segments and supervises without torch: importing it costs
a process about 150 MiB of private memory that the launcher would hold for the server's
life (its memory plan works from dtype names)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_launcher_imports_no_torch() -> None:
    code = "import sys, launcher.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
