"""The cgroup layouts: each read for real on a host that runs it (a process moved into
cgroups of its own: v1 here, v2 in the guest lane), v2 also from fixture files as the
kernel writes them (pressure, swap, OOM kills), and the directories a killed create
leaves, per layout."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cri_shim.runtime.cgroup_layout import (
    CGROUP_ROOT,
    CgroupV1,
    CgroupV2,
    cgroup_layout,
    read_pressure,
)
from cri_shim.runtime.handler_runtime import remove_cgroups

V1_HERE = (CGROUP_ROOT / "memory" / "memory.usage_in_bytes").exists() and os.geteuid() == 0
V2_HERE = (CGROUP_ROOT / "cgroup.controllers").exists() and os.geteuid() == 0
CONTROLLERS = ("memory", "cpuacct", "pids")
# Waits for a line, then touches 16 MiB (charged to the cgroup it was moved into).
ALLOCATE = (
    "import sys; sys.stdin.readline(); block = bytearray(16 << 20); "
    "[block.__setitem__(i, 1) for i in range(0, len(block), 4096)]; "
    "print('ready', flush=True); sys.stdin.readline()"
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@contextmanager
def process_in(directories: list[Path]) -> Iterator[subprocess.Popen[bytes]]:
    """A process moved into these new cgroup directories, which then allocates 16 MiB
    there and waits. Killed and the directories removed afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-c", ALLOCATE], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        for directory in directories:
            directory.mkdir()
            (directory / "cgroup.procs").write_text(str(process.pid))
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(b"go\n")
        process.stdin.flush()
        assert process.stdout.readline() == b"ready\n"
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)
        for directory in directories:
            if directory.exists():
                directory.rmdir()


@pytest.fixture
def v1_process() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A process in v1 cgroups of its own (memory, cpuacct, pids)."""
    if not V1_HERE:
        pytest.skip("needs cgroup v1 mounted at /sys/fs/cgroup, as root")
    group = f"/cri-shim-test-{uuid.uuid4().hex[:12]}"
    with process_in([CGROUP_ROOT / c / group[1:] for c in CONTROLLERS]) as process:
        yield group, process


@pytest.fixture
def v2_process() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A process in a cgroup of its own in the unified hierarchy (with the memory
    controller, which the root enables for its children)."""
    if not V2_HERE:
        pytest.skip("needs cgroup v2 mounted at /sys/fs/cgroup, as root")
    group = f"/cri-shim-test-{uuid.uuid4().hex[:12]}"
    with process_in([CGROUP_ROOT / group[1:]]) as process:
        yield group, process


def test_v1_reads_a_real_cgroup(v1_process: tuple[str, subprocess.Popen[bytes]]) -> None:
    group, process = v1_process
    layout = cgroup_layout()
    assert isinstance(layout, CgroupV1)
    stats = layout.stats(group)
    assert stats.cpu_usage_ns is not None and stats.cpu_usage_ns > 0
    assert stats.memory_usage_bytes is not None and stats.memory_usage_bytes >= 16 << 20
    assert stats.memory_working_set_bytes is not None and stats.memory_working_set_bytes > 0
    assert stats.pressure == {}  # v1 keeps none
    assert layout.oom_kills(group) == 0
    figures = layout.figures(group)
    assert figures.pids == [process.pid] and figures.processes == 1


def test_v2_reads_a_real_cgroup(v2_process: tuple[str, subprocess.Popen[bytes]]) -> None:
    group, process = v2_process
    layout = cgroup_layout()
    assert isinstance(layout, CgroupV2)
    stats = layout.stats(group)
    assert stats.cpu_usage_ns is not None and stats.cpu_usage_ns > 0
    assert stats.memory_usage_bytes is not None and stats.memory_usage_bytes >= 16 << 20
    if (CGROUP_ROOT / group[1:] / "memory.pressure").exists():  # PSI in the kernel
        assert stats.pressure["memory"].some[0] >= 0
    assert layout.oom_kills(group) == 0
    assert layout.figures(group).pids == [process.pid]


def test_v1_removal_takes_the_empty_cgroup_from_every_hierarchy(
    v1_process: tuple[str, subprocess.Popen[bytes]],
) -> None:
    group, process = v1_process
    layout = cgroup_layout()
    remove_cgroups(group, layout)
    assert (CGROUP_ROOT / "memory" / group[1:]).exists()  # in use: stays
    process.kill()
    process.wait(timeout=10)
    remove_cgroups(group, layout)
    assert not [d for d in layout.directories(group) if d.exists()]


PRESSURE = (
    "some avg10=1.50 avg60=0.75 avg300=0.10 total=123456\n"
    "full avg10=0.50 avg60=0.25 avg300=0.05 total=65432\n"
)


def v2_tree(root: Path) -> Path:
    write(root / "cgroup.controllers", "cpuset cpu io memory hugetlb pids\n")
    group = root / "kubepods.slice" / "cri-shim-c1.scope"
    write(group / "cpu.stat", "usage_usec 2000\nuser_usec 1500\nsystem_usec 500\n")
    write(group / "memory.current", "10000\n")
    write(group / "memory.stat", "anon 6000\nfile 3000\ninactive_file 1000\n")
    write(group / "memory.swap.current", "4096\n")
    write(group / "memory.swap.max", "65536\n")
    write(group / "memory.events", "low 0\nhigh 0\nmax 7\noom 2\noom_kill 1\n")
    write(group / "cpu.pressure", PRESSURE)
    write(group / "memory.pressure", PRESSURE)
    write(group / "io.pressure", PRESSURE)
    return group


def test_v2_stats_carry_swap_and_pressure(tmp_path: Path) -> None:
    v2_tree(tmp_path)
    layout = cgroup_layout(tmp_path)
    assert isinstance(layout, CgroupV2)
    stats = layout.stats("/kubepods.slice/cri-shim-c1.scope")
    assert (stats.cpu_usage_ns, stats.memory_working_set_bytes) == (2_000_000, 9000)
    assert (stats.swap_usage_bytes, stats.swap_limit_bytes) == (4096, 65536)
    assert set(stats.pressure) == {"cpu", "memory", "io"}
    assert stats.pressure["io"].some == (123456, 1.5, 0.75, 0.1)
    assert stats.pressure["io"].full == (65432, 0.5, 0.25, 0.05)
    assert layout.oom_kills("/kubepods.slice/cri-shim-c1.scope") == 1


def test_v2_unlimited_swap_and_missing_pressure(tmp_path: Path) -> None:
    group = v2_tree(tmp_path)
    (group / "memory.swap.max").write_text("max\n")
    (group / "io.pressure").unlink()
    (group / "cpu.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=9\n")
    stats = cgroup_layout(tmp_path).stats("/kubepods.slice/cri-shim-c1.scope")
    assert stats.swap_limit_bytes is None
    assert set(stats.pressure) == {"cpu", "memory"}
    assert stats.pressure["cpu"].full is None  # kernels before 5.13 write no `full` for cpu


def test_v2_gone_cgroup_reads_as_nothing(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "memory\n")
    layout = cgroup_layout(tmp_path)
    stats = layout.stats("/gone")
    assert stats.cpu_usage_ns is None and stats.swap_usage_bytes is None and not stats.pressure
    assert layout.oom_kills("/gone") == 0
    assert read_pressure(tmp_path / "gone" / "cpu.pressure") is None


def test_v1_swap_is_what_memsw_allows_beyond_memory(tmp_path: Path) -> None:
    memory = tmp_path / "memory" / "g"
    write(memory / "memory.stat", "total_swap 2048\ntotal_inactive_file 0\n")
    write(memory / "memory.usage_in_bytes", "100\n")
    write(memory / "memory.limit_in_bytes", "1000\n")
    write(memory / "memory.memsw.limit_in_bytes", "3000\n")
    stats = cgroup_layout(tmp_path, v2=False).stats("/g")
    assert (stats.swap_usage_bytes, stats.swap_limit_bytes) == (2048, 2000)
    assert stats.pressure == {}


def test_v2_removal_looks_in_the_one_hierarchy(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "memory\n")
    (tmp_path / "pod" / "cri-shim-c1").mkdir(parents=True)
    remove_cgroups("/pod/cri-shim-c1", cgroup_layout(tmp_path))
    assert not (tmp_path / "pod" / "cri-shim-c1").exists()
    assert (tmp_path / "pod").exists()


def test_v2_members_include_the_scopes_children(tmp_path: Path) -> None:
    # crun under systemd's driver: the processes are in the scope's `container` child.
    group = v2_tree(tmp_path)
    write(group / "cgroup.procs", "")
    write(group / "cgroup.threads", "")
    write(group / "container" / "cgroup.procs", "41\n42\n")
    write(group / "container" / "cgroup.threads", "41\n42\n43\n")
    figures = cgroup_layout(tmp_path).figures("/kubepods.slice/cri-shim-c1.scope")
    assert (figures.processes, figures.threads, figures.pids) == (2, 3, [41, 42])
