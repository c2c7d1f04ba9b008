"""GPU assignment from explicit inventories, and NVML failing safe to CPU on this machine."""

from __future__ import annotations

import shlex

import pytest

from launcher.args import parse_args
from launcher.engine_plan import shares_weights
from launcher.gpus import (
    GpuAssignmentError,
    GpuInfo,
    assign_gpus,
    cuda_env,
    discover_gpus,
    visible_subset,
)
from launcher.settings import Device, ServerConfig

GIB = 1 << 30


def _gpus(n: int, free_gib: float = 80.0) -> list[GpuInfo]:
    return [GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 * GIB, int(free_gib * GIB)) for i in range(n)]


def test_prefill_takes_the_first_gpus_and_decode_the_next() -> None:
    a = assign_gpus(parse_args(shlex.split("--prefill 2 --decode 4")), _gpus(8))
    assert (a.device, a.prefill, a.decode) == (Device.CUDA, (0, 1), (2, 3, 4, 5))


def test_explicit_lists_may_share_a_gpu_between_roles() -> None:
    cfg = parse_args(shlex.split("--prefill 1 --decode 2 --prefill-gpus 0 --decode-gpus 0,1"))
    a = assign_gpus(cfg, _gpus(2))
    assert (a.prefill, a.decode) == ((0,), (0, 1))


def test_one_explicit_list_leaves_the_other_role_the_remaining_gpus() -> None:
    cfg = parse_args(shlex.split("--prefill 2 --decode 2 --prefill-gpus 2,3"))
    assert assign_gpus(cfg, _gpus(4)).decode == (0, 1)
    cfg = parse_args(shlex.split("--prefill 1 --decode 2 --decode-gpus 0,1"))
    assert assign_gpus(cfg, _gpus(3)).prefill == (2,)


def test_too_few_gpus_is_an_error_naming_what_was_found_and_asked() -> None:
    with pytest.raises(GpuAssignmentError) as err:
        assign_gpus(parse_args(shlex.split("--prefill 2 --decode 4")), _gpus(4))
    msg = str(err.value)
    assert "4 decode worker(s)" in msg and "GPU3 NVIDIA H100" in msg and "--device cpu" in msg


def test_a_listed_gpu_that_does_not_exist_is_an_error() -> None:
    cfg = parse_args(shlex.split("--prefill 1 --decode 1 --prefill-gpus 5"))
    with pytest.raises(GpuAssignmentError, match=r"--prefill-gpus names GPU\(s\) \[5\]"):
        assign_gpus(cfg, _gpus(2))


def test_no_gpu_under_auto_means_everything_on_cpu() -> None:
    a = assign_gpus(parse_args(shlex.split("--prefill 2 --decode 3")), [])
    assert a.on_cpu and a.prefill == (None, None) and a.decode == (None,) * 3


def test_device_cpu_ignores_gpus_that_are_present() -> None:
    a = assign_gpus(parse_args(["--device", "cpu"]), _gpus(8))
    assert a.on_cpu and a.prefill == (None,) and a.decode == (None,)


def test_device_cuda_without_a_gpu_is_an_error() -> None:
    with pytest.raises(GpuAssignmentError, match="no NVIDIA GPU found"):
        assign_gpus(parse_args(["--device", "cuda"]), [])


def test_colocated_workers_take_one_gpu_each() -> None:
    a = assign_gpus(parse_args(["--colocated", "3"]), _gpus(4))
    assert (a.colocated, a.prefill, a.decode) == ((0, 1, 2), (), ())
    with pytest.raises(GpuAssignmentError):
        assign_gpus(parse_args(["--colocated", "5"]), _gpus(4))


def test_a_busy_gpu_is_reported_but_still_assigned(caplog: pytest.LogCaptureFixture) -> None:
    a = assign_gpus(ServerConfig(), _gpus(2, free_gib=10))
    assert a.prefill == (0,)
    assert "less free memory" in caplog.text


def test_discovery_without_nvml_or_a_gpu_returns_no_gpus_instead_of_failing() -> None:
    # This machine has no NVIDIA driver: NVML fails and discovery must say "no GPU".
    import torch

    if torch.cuda.is_available():
        assert len(discover_gpus()) >= 1
    else:
        assert discover_gpus() == ()
        assert assign_gpus(ServerConfig()).on_cpu


def test_worker_environment_pins_one_gpu_in_pci_order() -> None:
    assert cuda_env(3) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}
    assert cuda_env(None) == {"CUDA_VISIBLE_DEVICES": ""}


def _named(n: int) -> list[GpuInfo]:
    return [
        GpuInfo(i, "NVIDIA H100", 80 * GIB, 80 * GIB, uuid=f"GPU-{i:x}abc-{i}") for i in range(n)
    ]


@pytest.mark.parametrize(
    ("visible", "want"),
    [
        (None, [0, 1, 2, 3]),  # not set: every GPU of the host
        ("", []),  # set and empty: none (CUDA sees none either)
        ("2,3", [2, 3]),
        ("3,1", [1, 3]),  # taken in index order
        ("GPU-2abc-2, GPU-0", [0, 2]),  # UUIDs, or unique prefixes of them
        ("1,7,2", [1]),  # an entry that names no GPU ends the list, as for CUDA
        ("GPU-", []),  # a prefix of several GPUs names none
    ],
)
def test_cuda_visible_devices_given_to_launch_narrows_the_gpus(
    visible: str | None, want: list[int]
) -> None:
    assert [g.index for g in visible_subset(_named(4), visible)] == want


def test_a_mig_instance_is_refused_with_what_to_do() -> None:
    with pytest.raises(GpuAssignmentError, match="MIG"):
        visible_subset(_named(2), "MIG-5c4e3f2a-0000-1111-2222-333344445555")


@pytest.mark.parametrize(
    ("args", "shared"),
    [
        ("--prefill 2 --decode 2", True),  # the default: several workers map one copy
        ("--prefill 1 --decode 1", True),
        ("--colocated 1", False),  # a lone worker shares with nobody: private, prepacked
        ("--colocated 1 --share-weights", True),
        ("--prefill 2 --decode 2 --no-share-weights", False),
    ],
)
def test_weights_are_shared_by_default_only_between_cpu_workers(args: str, shared: bool) -> None:
    config = parse_args(["--device", "cpu", *shlex.split(args)])
    assert shares_weights(config, assign_gpus(config, [])) is shared
    on_gpus = parse_args(shlex.split(args))
    assert not shares_weights(on_gpus, assign_gpus(on_gpus, _gpus(8)))  # weights on the GPUs
