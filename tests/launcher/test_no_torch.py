"""The launcher plans, creates segments and supervises without torch: importing it costs
a process about 150 MiB of private memory that the launcher would hold for the server's
life (its memory plan works from dtype names)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bundled_models.tiny import tiny_model_dir


def test_importing_the_launcher_imports_no_torch() -> None:
    code = "import sys, launcher.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_converting_a_gguf_loads_torch_in_a_child_not_in_the_launcher(tmp_path: Path) -> None:
    """The first start converts the GGUF (torch, float32 tensors): in a process of its own,
    so the launcher that asked holds neither afterwards; a refused file still says why."""
    from tests.engine.gguf_files import write_gguf

    path = write_gguf(tiny_model_dir("qwen2"), tmp_path / "tiny.gguf", vocab=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from bundled_models.default_model import resolve_model\n"
        "from engine.errors import UnsupportedModelError\n"
        f"out = resolve_model(Path({str(path)!r}))\n"
        "assert (out / 'config.json').exists() and (out / 'model.safetensors').exists()\n"
        "try:\n"
        f"    resolve_model(Path({str(bad)!r}))\n"
        "    raise SystemExit('a broken GGUF was converted')\n"
        "except UnsupportedModelError as e:\n"
        "    assert 'not a readable GGUF' in str(e), e\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=env)
