"""A gVisor pod's limits: the pod's total, and what is written where."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.sandbox_cgroups import (
    UNLIMITED,
    cgroup_writes,
    merged_resources,
    pod_total,
    record_overhead,
    recorded_overhead,
    unappliable,
    write_cgroup,
)


def test_an_update_replaces_only_the_fields_it_gives() -> None:
    current = {"cpu": {"shares": 512, "quota": 50000}, "memory": {"limit": 64 << 20}}
    update = {"cpu": {"quota": 20000}, "memory": {"limit": 96 << 20}}
    assert merged_resources(current, update) == {
        "cpu": {"shares": 512, "quota": 20000},
        "memory": {"limit": 96 << 20},
    }


def test_the_pod_total_sums_limits_every_container_has() -> None:
    total = pod_total(
        [
            {"cpu": {"shares": 512, "quota": 50000, "period": 100000, "cpus": "0-1"},
             "memory": {"limit": 64 << 20, "swap": 64 << 20}},
            {"cpu": {"shares": 256, "quota": 10000, "period": 50000, "cpus": "3"},
             "memory": {"limit": 32 << 20, "swap": 32 << 20}},
        ]
    )  # fmt: skip
    assert total["cpu"] == {
        "shares": 768,
        "period": 100000,
        "quota": 70000,  # 10 ms in 50 ms is 20 ms in 100 ms
        "cpus": "0-1,3",
        "mems": "",
    }
    assert total["memory"] == {"limit": 96 << 20, "swap": 96 << 20}


def test_one_unlimited_container_leaves_the_pod_unlimited() -> None:
    total = pod_total(
        [
            {"cpu": {"shares": 512, "quota": 50000, "cpus": "0"}, "memory": {"limit": 64 << 20}},
            {"cpu": {"shares": 2}},
        ]
    )
    assert total["cpu"]["quota"] == UNLIMITED
    assert total["cpu"]["cpus"] == ""  # the parent's: every CPU the pod may have
    assert total["memory"]["limit"] == UNLIMITED
    assert total["cpu"]["shares"] == 514


def test_huge_cpu_sets_are_united_as_intervals() -> None:
    # Specs written before requests were checked against the host may name billions of
    # CPUs: the union is of intervals, never of their numbers.
    total = pod_total(
        [{"cpu": {"cpus": "0-8999999999"}}, {"cpu": {"cpus": "5,9000000000-9000000002"}}]
    )
    assert total["cpu"]["cpus"] == "0-9000000002"


def test_v1_memory_and_swap_are_written_in_an_order_the_kernel_takes() -> None:
    writes = cgroup_writes({"memory": {"limit": 100, "swap": 200}}, v2=False)
    assert writes == [
        ("memory", "memory.memsw.limit_in_bytes", "-1"),
        ("memory", "memory.limit_in_bytes", "100"),
        ("memory", "memory.memsw.limit_in_bytes", "200"),
    ]


def test_v2_files_and_units() -> None:
    writes = cgroup_writes(
        {"cpu": {"shares": 1024, "quota": UNLIMITED, "cpus": "0-1"},
         "memory": {"limit": 100, "swap": 300}},
        v2=True,
    )  # fmt: skip
    assert writes == [
        ("", "cpu.weight", "39"),
        ("", "cpu.max", "max 100000"),
        ("", "cpuset.cpus", "0-1"),
        ("", "memory.max", "100"),
        ("", "memory.swap.max", "200"),
    ]


def _v1_group(root: Path, relative: str, controllers: tuple[str, ...]) -> None:
    for controller in controllers:
        (root / controller / relative).mkdir(parents=True)


def test_writes_land_in_each_hierarchy_and_an_empty_cpuset_is_the_parents(tmp_path: Path) -> None:
    _v1_group(tmp_path, "pod/sandbox", ("cpu", "cpuset", "memory"))
    (tmp_path / "cpuset" / "pod" / "cpuset.cpus").write_text("0-3\n")
    resources = {"cpu": {"shares": 300, "quota": UNLIMITED, "cpus": ""}, "memory": {"limit": 5}}
    write_cgroup("/pod/sandbox", resources, v2=False, swap_accounting=False, cgroup_root=tmp_path)
    assert (tmp_path / "cpu/pod/sandbox/cpu.shares").read_text() == "300"
    assert (tmp_path / "cpu/pod/sandbox/cpu.cfs_quota_us").read_text() == "-1"
    assert (tmp_path / "cpuset/pod/sandbox/cpuset.cpus").read_text() == "0-3"
    assert (tmp_path / "memory/pod/sandbox/memory.limit_in_bytes").read_text() == "5"
    # No swap accounting: no memsw file is written.
    assert not (tmp_path / "memory/pod/sandbox/memory.memsw.limit_in_bytes").exists()


def test_a_gone_cgroup_is_skipped_and_a_refused_value_is_named(tmp_path: Path) -> None:
    write_cgroup("/gone", {"cpu": {"shares": 2}}, v2=False, swap_accounting=True,
                 cgroup_root=tmp_path)  # fmt: skip
    _v1_group(tmp_path, "pod", ("cpu",))
    (tmp_path / "cpu/pod/cpu.shares").mkdir()  # a write to it fails as the kernel's would
    with pytest.raises(FailedPrecondition, match=r"cpu\.shares .* to 2"):
        write_cgroup("/pod", {"cpu": {"shares": 2}}, v2=False, swap_accounting=True,
                     cgroup_root=tmp_path)  # fmt: skip


def test_pids_limits_sum_and_what_has_no_sum_is_named() -> None:
    total = pod_total([{"pids": {"limit": 100}}, {"pids": {"limit": 50}}])
    assert total["pids"] == {"limit": 150}
    assert pod_total([{"pids": {"limit": 100}}, {}])["pids"] == {"limit": UNLIMITED}
    assert cgroup_writes({"pids": {"limit": UNLIMITED}}, v2=False) == [("pids", "pids.max", "max")]
    update = {"cpu": {}, "hugepageLimits": [], "unified": {"memory.high": "1"}, "blockIO": {}}
    assert unappliable(update) == ["blockIO", "unified"]


def test_the_pods_overhead_is_added_to_finite_totals_only() -> None:
    overhead = {"cpu": {"shares": 128, "quota": 5000, "period": 50000}, "memory": {"limit": 7}}
    limited = [{"cpu": {"shares": 512, "quota": 50000}, "memory": {"limit": 64}}]
    total = pod_total(limited, overhead)
    assert total["cpu"]["shares"] == 640
    assert total["cpu"]["quota"] == 60000  # 5 ms in 50 ms is 10 ms in 100 ms
    assert total["memory"]["limit"] == 71
    unlimited = pod_total([{"cpu": {"shares": 2}}], overhead)
    assert unlimited["cpu"]["quota"] == UNLIMITED
    assert unlimited["memory"]["limit"] == UNLIMITED
    assert unlimited["cpu"]["shares"] == 130


def test_the_overhead_is_noted_in_the_sandbox_spec_not_given_to_runsc() -> None:
    spec: dict[str, Any] = {"annotations": {}, "linux": {}}
    record_overhead(spec, api_pb2.LinuxContainerResources())
    assert recorded_overhead(spec) == {}
    record_overhead(spec, api_pb2.LinuxContainerResources(memory_limit_in_bytes=16 << 20))
    assert recorded_overhead(spec)["memory"]["limit"] == 16 << 20
    assert "resources" not in spec["linux"]
