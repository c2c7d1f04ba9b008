"""``tools/check_layers.py``: floors between packages, rooms inside ``frontend`` and ``engine``."""

from __future__ import annotations

from pathlib import Path

from tools.check_layers import layer_offences, module_graph, unplaced_modules


def test_the_tree_passes() -> None:
    graph = module_graph(Path(__file__).resolve().parents[2])
    assert layer_offences(graph) == [] and unplaced_modules(graph) == []


def test_a_room_may_import_a_lower_room_only() -> None:
    graph = {
        "frontend.http.app": {
            "frontend.api.common.protocol",
            "frontend.errors",
            "frontend.http.guard",
        },
        "frontend.engine_link.recovery": {"frontend.http.app"},
        "frontend.api.common.protocol": {"frontend.telemetry.metrics"},
        "frontend.telemetry.metrics": {"frontend.api.common.protocol"},
    }
    assert layer_offences(graph) == [
        "frontend.engine_link.recovery imports frontend.http.app: "
        "room frontend.http is not below frontend.engine_link",
        "frontend.telemetry.metrics imports frontend.api.common.protocol: "
        "room frontend.api is not below frontend.telemetry",
    ]


def test_rooms_on_one_floor_do_not_import_each_other() -> None:
    assert layer_offences({"frontend.settings": {"frontend.errors"}}) == [
        "frontend.settings imports frontend.errors: room frontend.errors is not below "
        "frontend.settings"
    ]


def test_a_module_outside_every_room_is_named() -> None:
    (line,) = unplaced_modules({"frontend.misc.thing": set(), "frontend.http.app": set()})
    assert line.startswith("frontend.misc.thing is in no room of frontend")


def test_engine_model_code_knows_nothing_of_kv_cuda_or_the_runner() -> None:
    graph = {
        "engine.model.causal_lm": {"engine.weights.linear", "engine.kv.sequence"},
        "engine.kv.sequence": {"engine.sampling.grammar"},
        "engine.sampling.sampler": {"engine.cuda.kernels.backend"},
        "engine.cuda.kernel_path": {"engine.model.causal_lm", "engine.runner"},
    }
    assert layer_offences(graph) == [
        "engine.cuda.kernel_path imports engine.runner: room engine.runner is not below "
        "engine.cuda",
        "engine.model.causal_lm imports engine.kv.sequence: room engine.kv is not below "
        "engine.model",
        "engine.sampling.sampler imports engine.cuda.kernels.backend: room engine.cuda is not "
        "below engine.sampling",
    ]
