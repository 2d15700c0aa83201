"""ContainerStats carries what cgroup v2 adds (read by runtime/cgroup_layout.py): swap
usage and what is left of the limit, and the pressure stall figures of CPU, memory and
I/O; a v1 cgroup, which keeps no pressure, gets none rather than zeros."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.inspection.usage import ContainerUsage
from cri_shim.runtime.cgroup_layout import cgroup_layout
from cri_shim.runtime.stats import LayerUsage
from cri_shim.server.stats_messages import container_stats_message
from cri_shim.state.records import ContainerRecord

PRESSURE = (
    "some avg10=2.00 avg60=1.00 avg300=0.50 total=4000\n"
    "full avg10=1.00 avg60=0.50 avg300=0.25 total=2000\n"
)


class View:
    config = Config()


def record() -> ContainerRecord:
    fields: dict[str, Any] = {
        "id": "c1",
        "config": api_pb2.ContainerConfig(metadata=api_pb2.ContainerMetadata(name="c")),
    }
    return cast(ContainerRecord, type("Record", (), fields)())


def stats_of(root: Path, *, v2: bool) -> api_pb2.ContainerStats:
    cgroup = cgroup_layout(root, v2=v2).stats("/g")
    usage = ContainerUsage(record(), cgroup, None, LayerUsage(0, 0), 1)
    return container_stats_message(cast(Any, View()), usage)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_swap_and_pressure_reach_container_stats(tmp_path: Path) -> None:
    group = tmp_path / "g"
    write(group / "cpu.stat", "usage_usec 10\n")
    write(group / "memory.current", "100\n")
    write(group / "memory.swap.current", "1000\n")
    write(group / "memory.swap.max", "4000\n")
    for resource in ("cpu", "memory", "io"):
        write(group / f"{resource}.pressure", PRESSURE)
    stats = stats_of(tmp_path, v2=True)
    assert stats.swap.swap_usage_bytes.value == 1000
    assert stats.swap.swap_available_bytes.value == 3000
    for psi in (stats.cpu.psi, stats.memory.psi, stats.io.psi):
        assert (psi.Some.Total, psi.Some.Avg10, psi.Some.Avg60, psi.Some.Avg300) == (
            4000,
            2.0,
            1.0,
            0.5,
        )
        assert psi.Full.Total == 2000


def test_v1_gives_no_pressure(tmp_path: Path) -> None:
    write(tmp_path / "memory" / "g" / "memory.stat", "total_swap 0\n")
    write(tmp_path / "memory" / "g" / "memory.usage_in_bytes", "100\n")
    stats = stats_of(tmp_path, v2=False)
    assert not stats.cpu.HasField("psi") and not stats.memory.HasField("psi")
    assert not stats.HasField("io")
    assert stats.swap.swap_usage_bytes.value == 0
    assert not stats.swap.HasField("swap_available_bytes")  # no limit of its own
