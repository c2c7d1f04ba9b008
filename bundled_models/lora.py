"""PEFT LoRA adapters with random weights, for tests and benchmarks.

Written by ``peft`` itself (``get_peft_model`` + ``save_pretrained``), so the files are
exactly what users ship. PEFT starts B at zero (a fresh adapter changes nothing); here A
and B are both random and scaled so the update moves the logits visibly without
swamping the base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.weights.lora_spec import read_lora
from wire.params import LoraRef


def make_adapter(
    base: Path,
    out: Path,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    alpha: int | None = None,
    magnitude: float = 0.05,
    **extra: Any,
) -> Path:
    """Write a PEFT LoRA directory for ``base`` at ``out`` and return ``out``.

    ``extra``: more ``LoraConfig`` fields (``use_rslora``, ``use_dora`` ... for tests of
    what is refused).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        lora_dropout=0.0,
        **extra,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                # Unit-variance products: x @ A^T @ B^T stays near ``magnitude`` * |x|.
                fan = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=gen) * (magnitude / fan**0.5) ** 0.5)
    peft_model.save_pretrained(str(out))
    return out


def lora_ref(path: Path, name: str = "a") -> LoraRef:
    """What a request names to run under the adapter at ``path`` (fingerprint read back)."""
    return LoraRef(name=name, path=str(path), fingerprint=read_lora(path).fingerprint)


def make_adapter_refs(
    base: Path, root: Path, kinds: dict[str, tuple[int, tuple[str, ...]]]
) -> dict[str, LoraRef]:
    """One adapter per ``kinds`` entry (name -> rank, targets) under ``root``, seeds 1, 2, ..."""
    out = {}
    for i, (name, (rank, targets)) in enumerate(kinds.items()):
        out[name] = lora_ref(make_adapter(base, root / name, rank, targets, seed=i + 1), name)
    return out


def peft_model(base: Path, adapter: Path) -> Any:
    """transformers + peft's reference model for ``adapter`` on ``base`` (float32, eval)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()
