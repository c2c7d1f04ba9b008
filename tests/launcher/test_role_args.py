"""``launch --workers`` and its targets: what the command line accepts and refuses."""

from __future__ import annotations

import pytest

from launcher.args import parse_args
from launcher.role_args import slo_targets
from launcher.settings import ConfigError


def test_workers_are_colocated_workers_with_roles_and_device_targets() -> None:
    config = parse_args(["--workers", "3", "--device", "cpu"])
    assert (config.workers, config.colocated, config.disaggregated) == (3, 3, False)
    assert slo_targets(config, "cpu") == (2000.0, 100.0)
    assert slo_targets(config, "cuda") == (500.0, 50.0)
    tight = parse_args(["--workers", "2", "--slo-ttft-ms", "800", "--slo-tpot-ms", "40"])
    assert slo_targets(tight, "cpu") == (800.0, 40.0)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--workers", "-1"], "--workers"),
        (["--workers", "2", "--colocated", "1"], "--colocated"),
        (["--workers", "2", "--prefill", "2"], "--prefill"),
        (["--workers", "2", "--slo-tpot-ms", "0"], "--slo-tpot-ms"),
        (["--slo-ttft-ms", "500"], "--workers"),
        (["--allow-role-override"], "--workers"),
    ],
)
def test_role_flags_that_cannot_work_are_refused_naming_the_flag(
    argv: list[str], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        parse_args(argv)
