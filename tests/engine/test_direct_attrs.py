"""``DirectAttrs``: registered submodules, parameters and buffers read as plain attributes,
and stay the registered objects through every way torch changes them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.direct_attrs import DirectAttrs


class _Box(DirectAttrs):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("table", torch.zeros(4), persistent=False)
        self.plain = 5


def _in_step(box: _Box) -> None:
    d = box.__dict__
    for registry in (box._modules, box._parameters, box._buffers):
        for name, value in registry.items():
            assert d[name] is value, name


def test_registered_entries_are_plain_attributes_and_stay_in_step() -> None:
    box = _Box()
    _in_step(box)
    assert {"inner", "scale", "table"} <= set(box.__dict__) and box.plain == 5
    box.inner = nn.Linear(2, 3)  # a new submodule
    box.scale = nn.Parameter(torch.full((3,), 2.0))
    box.table = torch.ones(4)  # a tensor for a registered buffer
    box.register_buffer("table", torch.full((4,), 3.0))  # registered again
    box.add_module("extra", nn.ReLU())
    _in_step(box)
    assert box.inner.out_features == 3 and float(box.table[0]) == 3.0
    assert isinstance(box.extra, nn.ReLU)
    box.scale = None  # type: ignore[assignment]
    assert box.scale is None and box._parameters["scale"] is None
    del box.inner
    assert "inner" not in box.__dict__ and "inner" not in box._modules
    with pytest.raises(AttributeError):
        _ = box.inner


def test_conversions_that_replace_tensors_keep_them_in_step() -> None:
    box = _Box()
    box.to(torch.float64)
    _in_step(box)
    assert box.scale.dtype == torch.float64 and box.table.dtype == torch.float64
    assert box.state_dict().keys() == {"inner.weight", "inner.bias", "scale"}
