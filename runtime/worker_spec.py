"""What ``launch`` tells each worker process: one typed record per kind.

The launcher builds the record (``EngineWorkerSpec`` for prefill, decode and co-located
workers; ``runtime.strict_spec.DetokWorkerSpec`` for detokenizer shards, which must not
import torch as this module does; the frontend's is
``frontend.settings.FrontendLaunch``) and sends it, ``encode_spec``-ed, as the ``settings``
of the process's ``ProcessSpec``; the process reads it back with
``runtime.strict_spec.exit_on_bad_spec``, strictly.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.config import EngineConfig

KVTransferName = Literal["shm", "cuda_ipc", "nixl"]


class EngineWorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill, decode or co-located worker's settings."""

    log_level: str
    engine: EngineConfig
    # How KV moves between prefill and decode workers; None for a co-located worker. A
    # decode worker on a node that joined a cluster reads over ``nixl``.
    kv_transfer: KVTransferName | None
    # This node's name (``--node-name`` or the host name), claimed with the worker's
    # load-table row, so /health and /metrics name it; NIXL agents are named for it too.
    # Several hosts (docs/multi_host.md): for a prefill worker, the decode workers on other
    # hosts: it registers its pool with NIXL and sends them the handle, while local decode
    # workers keep ``kv_transfer``.
    node: str = ""
    remote_decode: list[int] = []
