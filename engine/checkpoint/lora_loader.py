"""The LoRA adapters resident in one worker's model: a bounded set of slots, LRU.

Who calls what: the runner, once per step, asks ``slots`` for each row's slot;
an adapter the step needs and no slot holds is loaded then (from the path its
``LoraRef`` names, checked against its fingerprint), into a free slot or the least
recently used one the step does not need. ``unload`` frees a slot at once; ``retire``
(the frontend unregistered the adapter) also keeps it out once no step needs it.

Memory is bounded: at most ``max_loras`` adapters of rank <= ``max_lora_rank`` are held,
each as one (A, B) pair per touched linear layer (``engine/weights/lora.py``), in banks
the caller may choose (``bank``: the CUDA path's stacked, preallocated ones).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.causal_lm import CausalLM
from engine.weights.linear import Linear
from engine.weights.lora import AdapterBank, LoraBank, LoraBatch, group_rows
from engine.weights.lora_spec import BaseDims, LoraError, LoraSpec, read_lora
from wire.params import LoraRef

logger = logging.getLogger(__name__)


class LoraCapacityError(LoraError):
    """A step needs more distinct adapters than there are slots."""


# (in_features, out_features, rank width) of a linear layer -> its adapter bank.
BankFactory = Callable[[int, int, int], AdapterBank]


class LoraAdapters:
    def __init__(
        self,
        model: CausalLM,
        model_dir: str,
        max_loras: int,
        max_rank: int,
        bank: BankFactory | None = None,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.base = BaseDims.from_model_dir(model_dir)
        self.dtype, self.device = model.embed.dtype, model.norm.weight.device
        self._by_fp: OrderedDict[str, int] = OrderedDict()  # fingerprint -> slot; LRU first
        self._free = list(range(max_loras - 1, -1, -1))
        self._checked: set[str] = set()  # fingerprints ``check`` passed
        # Unregistered by the frontend: evicted by the first step that does not need them.
        self._retired: set[str] = set()
        self.loads = 0  # adapters loaded, cumulative
        make = bank or (lambda k, n, width: LoraBank(max_loras))
        for lin, parts in self._linears():
            lin.lora = make(lin.in_features, lin.out_features, parts * max_rank)

    @property
    def resident(self) -> list[str]:
        """Fingerprints of the adapters held, least recently used first."""
        return list(self._by_fp)

    def batch(self, row_refs: list[LoraRef | None]) -> LoraBatch | None:
        """Each row's adapter (None: base) -> the step's rows by slot (``slots``)."""
        return group_rows(self.slots(row_refs), self.device)

    def slots(self, row_refs: list[LoraRef | None]) -> list[int]:
        """Each row's adapter (None: base) -> its slot (-1: base), loading any missing
        adapter first. Raises ``LoraError`` (unreadable, changed, unfit adapter) or
        ``LoraCapacityError`` (more distinct adapters than slots)."""
        needed = {r.fingerprint: r for r in row_refs if r is not None}
        if len(needed) > self.max_loras:
            raise LoraCapacityError(
                f"a step needs {len(needed)} adapters; --max-loras is {self.max_loras}"
            )
        for fp in [fp for fp in self._by_fp if fp in self._retired and fp not in needed]:
            self.unload(fp)  # its last request has finished
        for ref in needed.values():
            self._ensure(ref, keep=needed.keys())
        return [-1 if r is None else self._by_fp[r.fingerprint] for r in row_refs]

    def check(self, ref: LoraRef) -> None:
        """Raise ``LoraError`` unless ``ref`` can be served here (readable, unchanged since
        registered, fits this base and rank); the answer for a fingerprint is kept."""
        # NOTE: a request that arrives for a retired adapter means it was registered again.
        self._retired.discard(ref.fingerprint)
        if ref.fingerprint in self._checked or ref.fingerprint in self._by_fp:
            return
        self._read_fitting(ref)
        self._checked.add(ref.fingerprint)

    def groups(self, refs: list[LoraRef | None]) -> list[list[int]]:
        """Indices of ``refs`` in runs that need at most ``max_loras`` adapters each, in
        order: one run unless more distinct adapters are in flight than there are slots."""
        runs: list[list[int]] = [[]]
        seen: set[str] = set()
        for i, r in enumerate(refs):
            if r is not None and r.fingerprint not in seen:
                if len(seen) == self.max_loras:
                    runs.append([])
                    seen = set()
                seen.add(r.fingerprint)
            runs[-1].append(i)
        return runs

    def _ensure(self, ref: LoraRef, keep: Collection[str]) -> None:
        if ref.fingerprint in self._by_fp:
            self._by_fp.move_to_end(ref.fingerprint)
            return
        if not self._free:
            victim = next((fp for fp in self._by_fp if fp not in keep), None)
            assert victim is not None, "more adapters needed than slots (checked above)"
            self.unload(victim)
        slot = self._free.pop()
        try:
            self._load(slot, ref)
        except BaseException:
            self._clear(slot)
            self._free.append(slot)
            raise
        self._by_fp[ref.fingerprint] = slot
        self.loads += 1
        logger.info("LoRA %s (%s) loaded into slot %d", ref.name, ref.path, slot)

    def retire(self, fingerprint: str) -> bool:
        """The frontend unregistered this adapter: free its slot now; a request still in
        flight under it loads it again, and the first step without one evicts it.
        Returns whether it was resident."""
        self._retired.add(fingerprint)
        self._checked.discard(fingerprint)
        return self.unload(fingerprint)

    @property
    def nbytes(self) -> int:
        """Bytes of adapter weights held now (fixed with preallocated banks)."""
        return sum(lin.lora.nbytes for lin, _ in self._linears() if lin.lora is not None)

    def unload(self, fingerprint: str) -> bool:
        """Drop an adapter and free its slot's memory; False if it was not resident."""
        slot = self._by_fp.pop(fingerprint, None)
        if slot is None:
            return False
        self._clear(slot)
        self._free.append(slot)
        return True

    def _clear(self, slot: int) -> None:
        for lin, _ in self._linears():
            assert lin.lora is not None
            lin.lora.clear(slot)

    def _linears(self) -> list[tuple[Linear, int]]:
        """Every linear layer adapters may touch, with the projections it fuses."""
        out = []
        for i in range(len(self.model.layers)):
            layer = self.model.layer(i)
            attn, mlp = layer.attn, layer.mlp
            out += [(attn.qkv, 3), (attn.o, 1), (mlp.gate_up, 2), (mlp.down, 1)]
        return out

    def _read_fitting(self, ref: LoraRef) -> LoraSpec:
        """``ref``'s adapter read from disk; ``LoraError`` unless it is the one registered
        (same fingerprint) and fits this base and rank."""
        spec = read_lora(ref.path)
        if spec.fingerprint != ref.fingerprint:
            raise LoraError(
                f"adapter {ref.name!r}: the files at {ref.path} changed since it "
                "was registered; load it again"
            )
        spec.check_fits(self.base, self.max_rank)
        return spec

    def _load(self, slot: int, ref: LoraRef) -> None:
        spec = self._read_fitting(ref)
        parts = self._read(spec)
        for layer_idx, by_target in parts.items():
            layer = self.model.layer(layer_idx)
            fused: list[tuple[Linear, list[str]]] = [
                (layer.attn.qkv, ["q_proj", "k_proj", "v_proj"]),
                (layer.attn.o, ["o_proj"]),
                (layer.mlp.gate_up, ["gate_proj", "up_proj"]),
                (layer.mlp.down, ["down_proj"]),
            ]
            for lin, names in fused:
                pair = self._fuse(lin, names, by_target, spec.scaling)
                if pair is not None:
                    assert lin.lora is not None
                    lin.lora.set(slot, *pair)

    def _read(self, spec: LoraSpec) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """layer -> target -> (A (r, K), B (N, r)) in the activation dtype."""
        raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        with safe_open(str(Path(spec.path) / "adapter_model.safetensors"), "pt") as f:
            for name, layer, target, which, _ in spec.tensors:
                raw.setdefault((layer, target), {})[which] = f.get_tensor(name)
        out: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        dev = self.device
        for (layer, target), ab in raw.items():
            # float32 math for the product: scaling is folded into B once, here.
            a, b = ab["A"].float(), ab["B"].float()
            out.setdefault(layer, {})[target] = (a.to(dev, self.dtype), b.to(dev, self.dtype))
        return out

    def _fuse(
        self,
        lin: Linear,
        names: list[str],
        by_target: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The parts' pairs as one: A stacked (sum r, K), B block-diagonal (N, sum r)."""
        present = [n for n in names if n in by_target]
        if not present:
            return None
        widths = [self.base.in_out(n)[1] for n in names]  # the parts' output rows, in order
        a = torch.cat([by_target[n][0] for n in present])  # (sum r, K)
        b = torch.zeros(lin.out_features, a.shape[0], dtype=a.dtype, device=a.device)
        col = 0
        for n in present:
            pa, pb = by_target[n]
            row = sum(widths[: names.index(n)])
            b[row : row + pb.shape[0], col : col + pa.shape[0]] = pb * scaling
            col += pa.shape[0]
        return a, b


def in_batch_order(
    parts: list[torch.Tensor], runs: list[list[int]], rows_each: list[int] | bool
) -> torch.Tensor:
    """Logits of runs of a batch -> the batch's order. ``rows_each``: rows per item (every
    position), or falsy for one row each."""
    if not rows_each:
        order = [i for run in runs for i in run]
        out = torch.cat(parts)
        return out[torch.tensor(order, device=out.device).argsort()]
    assert isinstance(rows_each, list)
    by_item: dict[int, torch.Tensor] = {}
    for run, part in zip(runs, parts):
        for i, rows in zip(run, part.split([rows_each[i] for i in run])):
            by_item[i] = rows
    return torch.cat([by_item[i] for i in range(len(rows_each))])


def lora_refusal(loras: LoraAdapters | None, lora: LoraRef | None) -> str | None:
    """Why a request under ``lora`` cannot run on an engine serving ``loras``, or None:
    checked on arrival so a step never meets an adapter it cannot load."""
    if lora is None:
        return None
    if loras is None:
        return "this worker serves no LoRA adapters (--enable-lora)"
    try:
        loras.check(lora)
    except LoraError as e:
        return str(e)
    return None


def lora_slots(loras: LoraAdapters | None, refs: list[LoraRef | None]) -> list[int] | None:
    """Each row's adapter slot, -1 for the base (loading what is missing, evicting what was
    retired); None when every row is base. Raises ``LoraError`` for an adapter row on an
    engine without adapters."""
    if loras is None:
        if any(r is not None for r in refs):
            raise LoraError("this worker serves no LoRA adapters (start it with --enable-lora)")
        return None
    slots = loras.slots(refs)
    return slots if any(s >= 0 for s in slots) else None
