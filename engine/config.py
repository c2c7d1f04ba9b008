"""Model and engine configuration: what a checkpoint is, and how the engine runs it.

``ModelConfig`` is read from a Hugging Face checkpoint directory (config.json and
generation_config.json). It accepts both the transformers<5 spelling of rope options
(``rope_theta`` + ``rope_scaling``) and the transformers>=5 one (``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch

# HF architecture name -> (qkv projections carry a bias, per-head RMSNorm on q and k).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 8192


def dtype_name(name: str, checkpoint_dtype: str) -> str:
    """``auto`` keeps the checkpoint's dtype; otherwise one of float32/bfloat16/float16.
    By name: the launcher plans with these and never imports torch (~150 MiB a process)."""
    if name == "auto":
        return checkpoint_dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, not {name!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (one of ``DTYPES``, or int8)."""
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only Llama-family model, as the engine needs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # without "rope_theta"; has "rope_type"
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype_name: str  # the checkpoint's, one of DTYPES
    sliding_window: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        root = Path(path)
        cfg = json.loads((root / "config.json").read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"{root}: architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if cfg.get("attention_bias"):
            qkv_bias = True
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r}: only silu")
        rope_theta, rope_scaling = _rope_options(cfg)
        num_heads = int(cfg["num_attention_heads"])
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=_eos_token_ids(root, cfg),
            dtype_name=_checkpoint_dtype(cfg),
            sliding_window=_sliding_window(cfg),
        )


def _rope_options(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params


def _checkpoint_dtype(cfg: dict[str, Any]) -> str:
    name = str(cfg.get("dtype") or cfg.get("torch_dtype"))
    return name if name in DTYPES else "float32"  # missing or another spelling: float32


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    # Qwen2 configs carry a window but disable it with use_sliding_window=false.
    if cfg.get("use_sliding_window") is False:
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _eos_token_ids(root: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    gen_path = root / "generation_config.json"
    eos: Any = None
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on decode workers (engine/speculative/); vLLM's field names.

    ``ngram`` proposes the tokens that followed the request's current suffix (the longest
    n-gram of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) earlier in its
    prompt or output; ``draft_model`` runs ``model`` (same vocabulary) greedily.
    ``num_speculative_tokens`` is the most drafts a step verifies (k; adaptive below it);
    with more than ``disable_by_batch_size`` requests running, a step does not speculate.
    ``adaptive`` False turns the cost-aware gate off (engine/speculative/cost.py): every request
    verifies every draft it is proposed, whatever it costs (tests, and measuring the
    verifier itself); ``disable_by_batch_size`` still applies.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: its checkpoint directory
    disable_by_batch_size: int = 4
    adaptive: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field to change."""
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method must be one of {SPECULATIVE_METHODS}, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("model (a draft checkpoint) goes with method draft_model, only")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config`` JSON -> a validated config; ``ValueError`` says what to fix."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object")
    known = {f.name: f for f in fields(SpeculativeConfig)}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"unknown field {key!r}; known: {', '.join(known)}")
        want: type = str if key in ("method", "model") else bool if key == "adaptive" else int
        # NOTE: a bool is an int to isinstance; only "adaptive" takes one.
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"{key} must be a {want.__name__}")
    config = SpeculativeConfig(**raw)
    config.validate()
    return config


# Where attention runs: "auto" (Triton kernels over the paged pool on CUDA, torch SDPA
# elsewhere) or one of the two forced (engine.cuda.kernels.use_kernels).
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a model; the fields are the CLI defaults."""

    model: str
    dtype: str = "auto"
    # auto | none | int8 | int4: weight storage (engine/weights/plan.py)
    quantization: str = "auto"
    # Packed layers also hold their weights in bfloat16 for GEMMs of many rows (prefill
    # chunks, large decode batches); the launcher sets it for CPU workers
    # (engine/weights/gemm.py).
    large_batch_gemm: bool = False
    # Rows from which those layers take the GEMM; 0: measured per weight shape at load.
    gemm_min_rows: int = 0
    # What that GEMM feeds the weights: bfloat16 | int8 (int8: on the packed layers' own
    # int4 tiles, no bfloat16 copy; engine/weights/int4_tiles.py ``gemm_inputs``).
    gemm_inputs: str = "bfloat16"
    # The host's weights segment (an inherited memfd, engine/checkpoint/shared_weights.py):
    # CPU workers map one copy of the read-only weights from it, the first one to load
    # writing it. None: this engine loads its own private copy.
    weights_fd: int | None = None
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_tokens: int = 65536  # CPU pool size when num_kv_blocks is None
    gpu_memory_utilization: float = 0.85
    # This engine's fraction of its GPU's total memory; None: gpu_memory_utilization (the
    # engine alone on its GPU). The launcher sets it when workers share a GPU.
    gpu_memory_share: float | None = None
    max_model_len: int | None = None  # None -> min(max_position_embeddings, 8192)
    max_num_seqs: int = 256
    chunked_prefill_size: int = 2048
    # Co-located workers run a step's prompt chunks and decode rows in one forward
    # (colocated/scheduler.py); off (the default: on a 2-core CPU it measured no faster),
    # two forwards, decode rows on their own kernels.
    mixed_batches: bool = False
    # Reuse the KV of a prompt's longest cached prefix (engine/kv/block_allocator.py); off,
    # no block is ever hashed and every prompt is computed in full.
    enable_prefix_caching: bool = True
    # Batch-invariant inference (engine/model/batch_invariance.py): a request's tokens and
    # logprobs never depend on what shares its steps (CPU only).
    deterministic: bool = False
    seed: int = 0
    # "auto": Triton kernels over the paged pool on CUDA (engine/cuda/kernels/), torch SDPA
    # elsewhere; "torch" or "triton" force one (see engine.cuda.kernels.use_kernels).
    attention_backend: str = "auto"
    enforce_eager: bool = False  # kernel path: no decode CUDA graphs
    # KV tiers beyond the pool (engine/kv/tiers/): the host's tier-2 segment (an inherited
    # fd and its size; None: off) and tier 3's directory (read here, written by the
    # launcher's persister).
    kv_offload_fd: int | None = None
    kv_offload_nbytes: int = 0
    kv_offload_dir: str | None = None
    # LoRA adapters resident at once (engine/checkpoint/lora_loader.py); 0: LoRA off.
    max_loras: int = 0
    max_lora_rank: int = 16
    # Decode workers only (prefill never speculates); None: one token per step.
    speculative: SpeculativeConfig | None = None

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if model.sliding_window is not None:
            # NOTE: attention here is always full; within the window it equals sliding.
            limit = min(limit, model.sliding_window)
        if self.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 1 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], not {self.max_model_len}")
        return self.max_model_len
