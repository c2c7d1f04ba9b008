"""The frontend's configuration: frozen records, built by the CLI or by tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runtime.strict_spec import decode_spec

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# NOTE: a grammar spec travels in GenerateRequest and KVTransfer records: this keeps them
# well inside the smallest ring they cross, and --max-schema-bytes cannot raise it.
MAX_GRAMMAR_BYTES = 64 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines for slow clients and caps on connections (``frontend/http/connections.py``).

    Defaults, and why: a request head is one packet for any real client, so 10 s for all
    of it is slack for a very slow link (Apache allows 20-40 s, nginx 60 s between reads);
    a body is KiBs to a MiB, and 60 s for all of it (nginx's figure) still takes the 8 MiB
    body limit at 140 KB/s; 5 s idle between requests is uvicorn's and Apache's keep-alive
    (nginx: 75 s). 1024 connections per client address is more than one client needs (a
    reverse proxy on the same host is one address: raise it there; 0 = no cap).
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 0  # 0: the descriptor limit less FD_RESERVE
    max_connections_per_peer: int = 1024  # 0: no cap


@dataclass(frozen=True)
class FrontendSettings:
    """What the HTTP layer needs to know about the model and its own limits.

    ``vocab_size`` is the model's (possibly padded) embedding size: token ids in prompts
    and ``stop_token_ids`` must lie below it. ``chat_template`` overrides the tokenizer's.
    ``model_aliases``: other names requests may use (``launch`` adds its ``--model`` path).

    Exposure (``frontend/http/guard.py``): with ``api_key`` every path but /health needs it
    (/metrics too, unless ``metrics_no_auth``); without one, requests must name this
    server in their Host header (``allowed_hosts`` adds names; ``"*"`` allows any).
    ``allow_special_tokens_in_content`` lets control-token text in chat messages become
    control tokens (the old behaviour; a user can then forge a system turn).
    ``eos_token_ids`` are the model's (its grammars end on them, as in the workers).

    What one request may cost (``frontend/api/common/limits.py``; docs/reliability.md): JSON
    nested at most ``max_json_depth`` levels anywhere in it (the body, tool call
    arguments, schemas: real schemas nest a dozen levels, and 64 leaves room for the body
    around them); ``tools`` of at most ``max_tools_bytes`` as compact JSON (256 KiB: a
    hundred rich tools); an output constraint (a schema, regex, grammar, or the one a
    forced tool choice makes) of at most ``max_schema_bytes``; and at most
    ``grammar_compile_timeout_s`` of wall-clock time to compile its grammar, in one of
    ``grammar_workers`` processes (``frontend/engine_link/grammar_pool.py``).
    ``tool_call_parser`` reads tool calls out of chat output (frontend/api/chat/tool_parsers.py);
    None: ``tool_choice: auto`` is refused. ``reasoning_parser`` (``qwen3``, ``deepseek_r1``:
    the ``<think>…</think>`` family) keeps reasoning apart from the answer in the chat-shaped
    APIs (``frontend/api/chat/run.py``); None: the output is all answer.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_logprobs: int = 20
    model_aliases: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    allowed_hosts: tuple[str, ...] = ()
    metrics_no_auth: bool = False
    allow_special_tokens_in_content: bool = False
    eos_token_ids: tuple[int, ...] = ()
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The workers serve batch-invariant (engine/model/batch_invariance.py): /health and
    # /v1/models say so, for clients that rely on it.
    deterministic: bool = False
    max_json_depth: int = 64
    max_tools_bytes: int = 256 * 1024
    max_schema_bytes: int = MAX_GRAMMAR_BYTES
    grammar_compile_timeout_s: float = 5.0
    grammar_workers: int = 2
    # LoRA (frontend/api/common/lora_registry.py): adapters served at once (0: LoRA off), the
    # largest rank, the adapters of --lora-modules, and the base checkpoint they must fit.
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    base_model_dir: str = ""


@dataclass(frozen=True)
class FrontendLaunch:
    """Everything ``launch`` hands the frontend process, as one typed record.

    It travels as the JSON ``settings`` of the frontend's ``ProcessSpec`` (``to_json`` /
    ``from_json``); ``model`` and ``log_level`` sit at the top level, where every role's
    bootstrap reads them. A key one side does not know, or one it lacks, is an error, not a
    setting silently lost: ``SpecError`` names it at startup.
    """

    model: str  # checkpoint directory: the tokenizer and chat template
    http: FrontendSettings
    connections: ConnectionLimits
    router_policy: str
    max_waiting_requests: int | None
    max_queued_prefill_tokens: int | None
    stall_timeout_s: float
    # This host's node name (``--node-name`` or the host name): /health and /metrics name
    # it for the shards, the frontends, and engine workers whose rows name no node.
    node: str
    log_level: str = "INFO"
    max_request_retries: int = 1  # resumes after worker deaths blamed on a request
    api_workers: int = 1  # frontend processes sharing the port (this is one of them)
    # A head node's ``--remote-decode`` reserve: decode indices other nodes bring. Until a
    # node brings one, /health cannot say where it runs (its node reads "").
    remote_decode: tuple[int, ...] = ()
    # ``--workers``: the (TTFT, TPOT) targets in ms its planner holds (router/planner.py),
    # and whether POST /roles may set roles by hand; None: no planner (fixed roles).
    slo_ms: tuple[float, float] | None = None
    allow_role_override: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FrontendLaunch:
        """Strictly, as every worker reads its spec (``runtime/worker_spec.py``)."""
        return decode_spec(d, cls)
