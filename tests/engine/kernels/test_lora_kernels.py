"""The Triton LoRA path (CPU interpreter here): the kernels against the torch math, and a
kernel runner serving several adapters and the base in one batch as the torch path does.

peft is imported inside the tests (``bundled_models.lora``): at module level it would import
triton before the conftest sets up the interpreter.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from bundled_models import tiny
from engine.build import build_engine
from engine.config import EngineConfig
from engine.cuda.kernels.lora import lora_update
from engine.cuda.lora_bank import StackedLoraBank
from engine.cuda.lora_tiles import TILE_ROWS, max_tiles, plan_tiles
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.weights.lora import LoraBank, LoraTiles, group_rows, lora_rows
from tests.engine.kernels.conftest import DEVICE
from tests.engine.kernels.test_kernel_runner import _EagerGraphs, _HostTransfers
from wire.params import LoraRef, SamplingParams

# Built (once, cached) on import: a test of this file may be the first to need it.
TINY_LLAMA = tiny.tiny_model_dir("llama")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = {  # name -> (rank, targets)
    "qvd8": (8, ("q_proj", "v_proj", "down_proj")),
    "all16": (16, ALL),
    "kogu16": (16, ("k_proj", "o_proj", "gate_proj", "up_proj")),
}
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")


def test_tiles_group_rows_by_adapter_and_leave_base_rows_out() -> None:
    slots = np.array([1, -1, 0, 1, -1] + [2] * (TILE_ROWS + 3))
    order, tiles = plan_tiles(slots)
    covered = {int(order[i]): int(s) for s, a, b in tiles.T for i in range(a, b)}
    assert covered == {i: int(s) for i, s in enumerate(slots) if s >= 0}
    assert sorted(order.tolist()) == list(range(len(slots)))
    assert all(0 < b - a <= TILE_ROWS for _, a, b in tiles.T)
    assert tiles.shape[1] <= max_tiles(len(slots), 3)
    _, padded = plan_tiles(slots, grid=max_tiles(len(slots), 3))
    assert (padded[0, tiles.shape[1] :] == -1).all()  # a graph's grid: empty tiles after
    _, none = plan_tiles(np.array([-1, -1]))
    assert none[0].tolist() == [-1]


def _reference(
    x: torch.Tensor, y: torch.Tensor, bank: StackedLoraBank, slots: list[int]
) -> torch.Tensor:
    """The torch path's LoraBank with the same pairs, on the same rows."""
    ref = LoraBank(bank.a.shape[0])
    for s, r in enumerate(bank._held):
        if r:
            ref.set(s, bank.a[s, :r], bank.b[s, :, :r])
    with lora_rows(group_rows(slots, x.device)):
        return ref(x, y.clone())


# bfloat16 on a GPU only: the interpreter's bfloat16 arithmetic is not torch's.
DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]
if torch.cuda.is_available():
    DTYPES.append((torch.bfloat16, 2e-2))


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_the_kernels_add_each_rows_adapter_update_and_leave_base_rows_alone(
    dtype: torch.dtype, tol: float
) -> None:
    g = torch.Generator().manual_seed(0)
    k, n, width, num_slots = 96, 80, 48, 4  # a qkv-like bank: 3 parts of rank 16
    bank = StackedLoraBank(num_slots, k, n, width, dtype, DEVICE)
    for slot, r in ((0, 8), (1, 48), (3, 16)):  # slot 2 stays empty
        a = torch.randn(r, k, generator=g) / k**0.5
        bank.set(slot, a.to(dtype).to(DEVICE), torch.randn(n, r, generator=g).to(dtype).to(DEVICE))
    # 40 rows: two adapters with more than a tile of rows, base rows, an unused slot.
    slots = [1, -1, 0, 3] * 6 + [1] * 12 + [-1, 2, 0, -1]
    x = torch.randn(len(slots), k, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(len(slots), n, generator=g).to(dtype).to(DEVICE)
    want = _reference(x, y, bank, slots)
    order, tiles = plan_tiles(np.array(slots), grid=max_tiles(len(slots), num_slots))
    rows = LoraTiles(
        torch.from_numpy(order).to(DEVICE), torch.from_numpy(tiles).contiguous().to(DEVICE)
    )
    got = y.clone()
    with lora_rows(rows):
        assert bank(x, got) is got  # in place, into the base output
    base = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base], y[base])
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (got.float() - y.float()).abs().max() > 0.5, "the update changed nothing"


def test_loading_writes_into_slots_without_moving_buffers() -> None:
    bank = StackedLoraBank(2, 32, 48, 16, torch.float32, DEVICE)
    addresses = (bank.a.data_ptr(), bank.b.data_ptr())
    bank.set(1, torch.ones(8, 32, device=DEVICE), torch.ones(48, 8, device=DEVICE))
    bank.set(1, torch.ones(4, 32, device=DEVICE), torch.ones(48, 4, device=DEVICE))
    assert bank.a[1, 4:].abs().sum() == 0 and bank.b[1, :, 4:].abs().sum() == 0  # no leftovers
    bank.clear(1)
    assert bank.a.abs().sum() == 0 and (bank.a.data_ptr(), bank.b.data_ptr()) == addresses
    x = torch.randn(3, 32, device=DEVICE)
    y = torch.randn(3, 48, device=DEVICE)
    lora_update(x, y, bank.a, bank.b, *_rows([0, 1, 0]))  # zero slots: y untouched
    assert torch.equal(y, y.clone())


def _rows(slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    order, tiles = plan_tiles(np.array(slots))
    return torch.from_numpy(order).to(DEVICE), torch.from_numpy(tiles).to(DEVICE)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoraRef]:
    if importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft")
    from bundled_models.lora import make_adapter_refs

    return make_adapter_refs(TINY_LLAMA, tmp_path_factory.mktemp("lora"), KINDS)


def _runner(backend: str, max_loras: int = 4) -> ModelRunner:
    return build_engine(
        EngineConfig(
            model=str(TINY_LLAMA),
            num_kv_blocks=64,
            max_num_seqs=8,
            max_loras=max_loras,
            device=DEVICE.type,
            attention_backend=backend,
        )
    ).runner


def _mixed_run(runner: ModelRunner, refs: list[LoraRef | None], steps: int) -> torch.Tensor:
    """Prefill (in chunks of 16) then decode a batch of one request per ref -> (B, S, V)."""
    g = torch.Generator().manual_seed(4)
    lens = [17, 9, 33, 21, 5][: len(refs)]
    seqs = [
        Sequence(
            i, torch.randint(0, 1000, (n,), generator=g).tolist(), sampling=SamplingParams(lora=r)
        )
        for i, (n, r) in enumerate(zip(lens, refs))
    ]
    last: dict[int, torch.Tensor] = {}  # each request's logits after its whole prompt
    while pending := [s for s in seqs if s.num_uncomputed_tokens > 0]:
        logits = runner.prefill([(s, min(16, s.num_uncomputed_tokens)) for s in pending])
        last.update((s.rid, row) for s, row in zip(pending, logits))
    out = [torch.stack([last[s.rid] for s in seqs])]
    for step in range(steps):
        for s in seqs:
            s.output_ids.append(300 + step)
        out.append(runner.decode(seqs))
    for s in seqs:
        runner.kv.free_blocks(s)
    return torch.stack(out, dim=1)


@needs_peft
def test_a_kernel_runner_serves_three_adapters_and_the_base_as_the_torch_path_does(
    adapters: dict[str, LoraRef],
) -> None:
    refs: list[LoraRef | None] = [adapters["qvd8"], None, adapters["all16"], adapters["kogu16"]]
    kernel, torch_ = _runner("triton"), _runner("torch")
    assert kernel._kernels is not None and kernel.loras is not None
    assert all(isinstance(lin.lora, StackedLoraBank) for lin, _ in kernel.loras._linears())
    path = kernel._kernels
    ran: list[int] = []
    path.lora_graphs = _EagerGraphs(lambda b: path._graph_forward(b, True), ran)  # type: ignore[assignment]
    got, want = _mixed_run(kernel, refs, steps=2), _mixed_run(torch_, refs, steps=2)
    torch.testing.assert_close(got, want.to(got.device), atol=1e-4, rtol=0)
    assert ran == [4, 4]  # 4 rows: the LoRA graph of bucket 4, its grid padded
    base = _mixed_run(torch_, [None] * 4, steps=2)
    for i, r in enumerate(refs):  # each adapter moved its own rows, the base row none
        moved = (base[i] - want[i].to(base.device)).abs().max().item()
        assert (moved > 1e-2) == (r is not None), (i, moved)


@needs_peft
def test_kernel_path_adapters_match_transformers_peft(adapters: dict[str, LoraRef]) -> None:
    from bundled_models.lora import peft_model

    ref = adapters["all16"]
    full = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        want = peft_model(TINY_LLAMA, Path(ref.path))(torch.tensor([full])).logits[0, 19:]
    runner = _runner("triton", max_loras=1)
    s = Sequence(0, full[:20], sampling=SamplingParams(lora=ref))
    rows = [runner.prefill([(s, s.num_tokens)])[0]]
    for t in full[20:]:
        s.output_ids.append(t)
        rows.append(runner.decode([s])[0])
    torch.testing.assert_close(torch.stack(rows).cpu(), want, atol=1e-4, rtol=0)


@needs_peft
def test_a_lora_decode_step_still_makes_one_host_to_device_copy(
    adapters: dict[str, LoraRef],
) -> None:
    """The rows by adapter and their tiles ride in the step's one staged copy."""
    runner = _runner("triton", max_loras=2)
    seqs = [
        Sequence(i, list(range(10 + i, 30 + i)), sampling=SamplingParams(lora=r))
        for i, r in enumerate([adapters["qvd8"], None, adapters["all16"]])
    ]
    runner.prefill([(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.output_ids.append(7)
    with _HostTransfers() as transfers:
        runner.decode(seqs)
    assert transfers.calls == ["copy_"], transfers.calls
