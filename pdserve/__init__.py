"""pdserve: disaggregated prefill/decode LLM serving on one host.

This package holds what every process shares and no single role owns: the embedded
tiny models, logging and process-title helpers. Roles live in their own top-level
packages (``engine``, ``transport``, ``prefill``, ``decode``, ``router``,
``detokenizer``, ``frontend``, ``launcher``).
"""

from __future__ import annotations

__version__ = "0.1.0"
