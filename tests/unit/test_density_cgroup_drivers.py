"""benchmarks/density.py on cgroup v2 and under each cgroup driver: where the runtime's
CPU time is read, which driver can be measured where, and the drivers' ratios."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from density import Result, driver_ratios, driver_refusal, mode_ratios
from runtime_cost import CpuAccount, cgroup_cpu_seconds, moved_out_seconds, unified_cgroup


def fake_cgroup_root(tmp_path: Path, v2: bool) -> Path:
    """A directory laid out as /sys/fs/cgroup is: the unified tree's root on cgroup v2,
    one hierarchy per controller on v1."""
    root = tmp_path / "fake-cgroup"
    if v2:
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    else:
        (root / "cpuacct").mkdir(parents=True)
    return root


def test_the_account_is_a_cgroup_of_the_unified_tree_on_v2(tmp_path: Path) -> None:
    root = fake_cgroup_root(tmp_path, v2=True)
    account = CpuAccount("density-1", root)
    assert account.path == root / "density-1"
    (account.path / "cpu.stat").write_text(
        "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 0\n"
    )
    assert account.seconds() == 2.5


def test_the_account_is_a_cpuacct_cgroup_on_v1(tmp_path: Path) -> None:
    root = fake_cgroup_root(tmp_path, v2=False)
    account = CpuAccount("density-1", root)
    assert account.path == root / "cpuacct" / "density-1"
    (account.path / "cpuacct.usage").write_text("1500000000\n")
    assert account.seconds() == 1.5


def test_a_cgroup_without_its_usage_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("nr_periods 0\n")
    with pytest.raises(ValueError, match="usage_usec"):
        cgroup_cpu_seconds(tmp_path)


def test_systemds_driver_is_measured_only_where_systemd_runs_on_cgroup_v2() -> None:
    assert driver_refusal("systemd", "cri-shim", systemd_running=True, v2=True) == ""
    assert driver_refusal("both", "cri-shim", systemd_running=True, v2=True) == ""
    assert "needs systemd as PID 1 on cgroup v2" in driver_refusal(
        "systemd", "cri-shim", systemd_running=False, v2=True
    )
    assert "cgroup v1" in driver_refusal("both", "cri-shim", systemd_running=True, v2=False)
    assert driver_refusal("cgroupfs", "cri-shim", systemd_running=False, v2=False) == ""


def test_systemds_driver_is_refused_for_the_containerd_peer() -> None:
    refusal = driver_refusal("both", "containerd", systemd_running=True, v2=True)
    assert "SystemdCgroup = false" in refusal
    assert driver_refusal("cgroupfs", "both", systemd_running=True, v2=True) == ""


def test_each_systemd_run_is_set_against_the_same_run_under_cgroupfs() -> None:
    def run(driver: str, start: list[float], removed: float, pods: int = 4) -> Result:
        return Result("cri-shim", "relay", driver, "plain", pods, start=start, removed=removed)

    results = [
        run("cgroupfs", [1.0, 2.0, 2.0, 4.0], 10.0),
        run("systemd", [1.5, 3.0, 3.0, 6.0], 12.0),
        # Not paired: no cgroupfs run of 8 pods.
        run("systemd", [1.0] * 8, 1.0, pods=8),
    ]
    assert driver_ratios(results) == [
        "cri-shim plain 4 pods: start p50 x1.50, p99 x1.50, removal x1.20"
    ]


def test_each_relay_run_is_set_against_the_same_bound_run() -> None:
    def run(mode: str, start: list[float], daemon_cpu: float, pods: int = 4) -> Result:
        return Result(
            "cri-shim",
            mode,
            "cgroupfs",
            "plain",
            pods,
            start=start,
            runtime_cpu=2 * daemon_cpu,
            daemon_cpu=daemon_cpu,
            alone=60.0,
            removed=2.0,
        )

    results = [
        run("bound", [1.0, 2.0, 2.0, 4.0], 2.0),
        run("relay", [1.0, 2.2, 2.2, 4.4], 2.5),
        run("relay", [1.0] * 8, 9.0, pods=8),  # not paired: no bound run of 8 pods
    ]
    assert mode_ratios(results) == [
        "cri-shim cgroupfs plain 4 pods: start p50 x1.10, p99 x1.10, runtime CPU x1.25, "
        "daemon CPU x1.25 (2.50 against 2.00 % of a core: the relay's share +20 %), "
        "alone PSS x1.00, removal x1.00"
    ]


def test_the_cgroups_helpers_were_moved_to_are_added_once_each(tmp_path: Path) -> None:
    root = fake_cgroup_root(tmp_path, v2=True)
    account = CpuAccount("density-1", root)
    # This process stands for a conmon moved to a scope of its own: its cgroup in the
    # unified tree, under the fake root.
    scope = unified_cgroup(os.getpid(), root)
    assert scope is not None and (scope == root or root in scope.parents)
    scope.mkdir(parents=True, exist_ok=True)
    (scope / "cpu.stat").write_text("usage_usec 3000000\n")
    gone = 2**22 + 1  # above the kernel's largest PID
    assert moved_out_seconds(account, [os.getpid(), os.getpid(), gone], root) == 3.0
    assert moved_out_seconds(account, [], root) == 0.0


def test_no_helper_is_moved_out_on_cgroup_v1(tmp_path: Path) -> None:
    root = fake_cgroup_root(tmp_path, v2=False)
    assert unified_cgroup(os.getpid(), root) is None
    assert moved_out_seconds(CpuAccount("density-1", root), [os.getpid()], root) == 0.0
