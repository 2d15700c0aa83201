"""Plugins' adjustments applied to an OCI spec: env, annotations, mounts, resource limits,
removals, conflicts between plugins, and what is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2 as cri_api
from cri_shim.nri.adjust import (
    AdjustmentRefused,
    adjust_update,
    apply_adjustments,
    nri_resources_of,
    oci_resources,
)
from cri_shim.nri.api import api_pb2
from tests.unit.test_cpusets import host_with_two_cpus


def spec() -> dict[str, Any]:
    return {
        "process": {"args": ["sh"], "env": ["PATH=/bin", "KEEP=1", "DROP=x"]},
        "annotations": {"a": "1"},
        "mounts": [{"destination": "/data", "type": "bind", "source": "/old", "options": []}],
        "linux": {"resources": {"memory": {"limit": 100}, "cpu": {"shares": 2}}},
    }


def test_env_annotations_mounts_and_limits_are_applied() -> None:
    adjustment = api_pb2.ContainerAdjustment(
        env=[api_pb2.KeyValue(key="NEW", value="v"), api_pb2.KeyValue(key="-DROP")],
        annotations={"b": "2", "-a": ""},
        mounts=[api_pb2.Mount(destination="/data", source="/new", options=["ro"])],
    )
    adjustment.linux.resources.memory.limit.value = 64 << 20
    adjustment.linux.resources.cpu.quota.value = 50_000
    adjustment.linux.resources.cpu.cpus = "0"
    adjustment.linux.resources.pids.limit = 99
    s = spec()
    apply_adjustments(s, [("10-a", adjustment)])
    assert s["process"]["env"] == ["PATH=/bin", "KEEP=1", "NEW=v"]
    assert s["annotations"] == {"b": "2"}
    assert s["mounts"] == [
        {"destination": "/data", "type": "bind", "source": "/new", "options": ["ro"]}
    ]
    assert s["linux"]["resources"]["memory"] == {"limit": 64 << 20}
    assert s["linux"]["resources"]["cpu"] == {"shares": 2, "quota": 50_000, "cpus": "0"}
    assert s["linux"]["resources"]["pids"] == {"limit": 99}


def test_a_later_plugin_may_adjust_other_things() -> None:
    first = api_pb2.ContainerAdjustment(env=[api_pb2.KeyValue(key="A", value="1")])
    second = api_pb2.ContainerAdjustment(env=[api_pb2.KeyValue(key="B", value="2")])
    s = spec()
    apply_adjustments(s, [("10-a", first), ("20-b", second)])
    assert s["process"]["env"][-2:] == ["A=1", "B=2"]


def test_two_plugins_adjusting_one_thing_conflict_and_nothing_changes() -> None:
    first = api_pb2.ContainerAdjustment(env=[api_pb2.KeyValue(key="A", value="1")])
    second = api_pb2.ContainerAdjustment(env=[api_pb2.KeyValue(key="-A")])
    s = spec()
    with pytest.raises(AdjustmentRefused, match="10-a and 20-b both adjust environment"):
        apply_adjustments(s, [("10-a", first), ("20-b", second)])
    assert s == spec()


def test_what_cannot_be_applied_is_refused_by_name() -> None:
    adjustment = api_pb2.ContainerAdjustment()
    adjustment.hooks.prestart.add(path="/bin/true")
    adjustment.linux.resources.memory.swappiness.value = 3
    with pytest.raises(AdjustmentRefused, match=r"hooks, .*linux\.resources\.memory\.swappiness"):
        apply_adjustments(spec(), [("10-a", adjustment)])


def test_a_relative_mount_destination_is_refused() -> None:
    adjustment = api_pb2.ContainerAdjustment(mounts=[api_pb2.Mount(destination="data")])
    with pytest.raises(AdjustmentRefused, match="not absolute"):
        apply_adjustments(spec(), [("10-a", adjustment)])


def test_args_and_oom_score_adj() -> None:
    adjustment = api_pb2.ContainerAdjustment(args=["sleep", "1"])
    adjustment.linux.oom_score_adj.value = 500
    s = spec()
    apply_adjustments(s, [("10-a", adjustment)])
    assert s["process"]["args"] == ["sleep", "1"] and s["process"]["oomScoreAdj"] == 500


def test_plugins_change_a_cri_update_in_order_and_conflicts_are_named() -> None:
    update = cri_api.LinuxContainerResources(memory_limit_in_bytes=1 << 20, cpu_shares=512)
    asked = nri_resources_of(update)
    assert (asked.memory.limit.value, asked.cpu.shares.value) == (1 << 20, 512)
    assert not asked.cpu.HasField("quota")
    memory = api_pb2.LinuxResources()
    memory.memory.limit.value = 2 << 20
    cpus = api_pb2.LinuxResources()
    cpus.cpu.cpus = "0-1"
    adjust_update(update, [("10-a", memory), ("20-b", cpus)])
    assert (update.memory_limit_in_bytes, update.cpuset_cpus, update.cpu_shares) == (
        2 << 20,
        "0-1",
        512,
    )
    with pytest.raises(
        AdjustmentRefused, match=r"NRI plugins 10-a and 30-c both change memory\.limit"
    ):
        adjust_update(update, [("10-a", memory), ("30-c", memory)])
    pids = api_pb2.LinuxResources()
    pids.pids.limit = 10
    with pytest.raises(AdjustmentRefused, match=r"NRI plugin 40-d: .*linux\.resources\.pids"):
        adjust_update(update, [("40-d", pids)])


def test_cpus_and_nodes_not_online_are_refused_on_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_with_two_cpus(tmp_path, monkeypatch)
    # A creation's adjustment: refused before the spec changes.
    adjustment = api_pb2.ContainerAdjustment()
    adjustment.linux.resources.cpu.cpus = "0-8000000"
    s = spec()
    with pytest.raises(AdjustmentRefused) as refused:
        apply_adjustments(s, [("10-a", adjustment)])
    assert str(refused.value) == (
        "NRI plugin 10-a: linux.resources.cpu.cpus: CPU 2 is not online on this host (online: 0-1)"
    )
    assert s == spec()
    # A change to a CRI update.
    nodes = api_pb2.LinuxResources()
    nodes.cpu.mems = "3"
    update = cri_api.LinuxContainerResources(cpu_shares=512)
    with pytest.raises(AdjustmentRefused, match=r"^NRI plugin 20-b: .*memory node 3 is not"):
        adjust_update(update, [("20-b", nodes)])
    assert update.cpuset_mems == ""
    # A plugin's own update (UpdateContainers), as OCI resources.
    with pytest.raises(AdjustmentRefused, match=r"cpu\.cpus: '0-99999999999' is not a CPU list"):
        oci_resources(api_pb2.LinuxResources(cpu=api_pb2.LinuxCPU(cpus="0-99999999999")))
