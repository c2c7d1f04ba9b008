"""The host's weights segment as the launcher creates it: an empty, sealable memfd.

Apart from ``shared_weights.py`` (which fills and maps it, with torch and the model) so
that the launcher, which only creates and hands it on, imports neither.
"""

from __future__ import annotations

import os

MAPPING_NAME = "pdserve-weights"  # as /proc/PID/maps shows it: /memfd:pdserve-weights


class SharedWeightsError(RuntimeError):
    """The host's weights segment cannot serve this worker; the message says why."""


def create_segment() -> int:
    """An empty, sealable memfd for the host's weights; the caller keeps the fd open.

    Raises ``SharedWeightsError`` where there are no sealable memfds (not Linux).
    """
    try:
        return os.memfd_create(MAPPING_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as e:
        raise SharedWeightsError(f"no sealable memfd here ({e})") from e
