"""One cgroup's files, per cgroup layout: v1 (one hierarchy per controller, a cgroup in
each) or v2 (one unified hierarchy). The daemon reads a container's cgroup through the
layout of its host only: ContainerStats (CPU, memory, swap, pressure), the CRI metrics
(runtime/cgroup_metrics.py), the OOM kills a container's exit reports, and the
directories a killed create leaves. Where a cgroup is (which driver named it) is
runtime/cgroup_driver.py's; what a figure means is the same on both layouts.

Pressure (PSI: cpu.pressure, memory.pressure, io.pressure) exists on v2 only; v1 reports
none rather than a guessed zero. A file that is missing (a controller not enabled, the
container gone) leaves its figure out.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path

from cri_shim.runtime.cgroup_metrics import CgroupFigures, read_v1_figures, read_v2_figures
from cri_shim.runtime.stats import (
    CgroupStats,
    PressureStall,
    read_flat_keyed,
    read_int,
    read_small_file,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 mounts cpuacct alone or together with cpu, depending on the distribution.
_CPUACCT_MOUNTS = ("cpuacct", "cpu,cpuacct", "cpuacct,cpu")
# v1's "no limit" is the largest page-aligned 64-bit value.
_V1_UNLIMITED = 1 << 62


class CgroupLayout(ABC):
    """The files of a cgroup given by its path below each hierarchy's root."""

    v2: bool

    def __init__(self, root: Path = CGROUP_ROOT) -> None:
        self.root = root

    @abstractmethod
    def stats(self, group: str) -> CgroupStats:
        """CPU, memory and swap counters, and pressure where the layout keeps it."""

    @abstractmethod
    def oom_kills(self, group: str) -> int:
        """Processes of the cgroup the kernel's OOM killer killed (0 when it is gone)."""

    def oom_events_file(self, group: str) -> Path | None:
        """The file whose modification signals an OOM kill in the cgroup as it happens
        (runtime/oom_watch.py), where the layout has one. v1 has none to watch: its count
        stays readable (oom_kills) until the runtime deletes the cgroup."""
        return None

    @abstractmethod
    def directories(self, group: str) -> list[Path]:
        """The cgroup's directory in every hierarchy (that exists or not)."""

    def figures(self, group: str) -> CgroupFigures:
        """cAdvisor's wider set (ListPodSandboxMetrics)."""
        base = self.stats(group)
        figures = CgroupFigures(
            cpu_usage_ns=base.cpu_usage_ns,
            memory_usage_bytes=base.memory_usage_bytes,
            memory_working_set_bytes=base.memory_working_set_bytes,
            memory_rss_bytes=base.memory_rss_bytes,
        )
        self._add_figures(group.lstrip("/"), figures)
        return figures

    @abstractmethod
    def _add_figures(self, relative: str, figures: CgroupFigures) -> None: ...


class CgroupV1(CgroupLayout):
    v2 = False

    def stats(self, group: str) -> CgroupStats:
        relative = group.lstrip("/")
        now = time.time_ns()
        cpu_usage = None
        for mount in _CPUACCT_MOUNTS:
            cpu_usage = read_int(self.root / mount / relative / "cpuacct.usage")
            if cpu_usage is not None:
                break
        memory_dir = self.root / "memory" / relative
        memory = read_flat_keyed(memory_dir / "memory.stat")
        usage = read_int(memory_dir / "memory.usage_in_bytes")
        swap_limit = read_int(memory_dir / "memory.memsw.limit_in_bytes")
        limit = read_int(memory_dir / "memory.limit_in_bytes")
        return CgroupStats(
            timestamp_ns=now,
            cpu_usage_ns=cpu_usage,
            memory_usage_bytes=usage,
            # total_* include child cgroups, which is what a container's figure must cover.
            memory_working_set_bytes=working_set(usage, memory.get("total_inactive_file")),
            memory_rss_bytes=memory.get("total_rss"),
            page_faults=memory.get("total_pgfault"),
            major_page_faults=memory.get("total_pgmajfault"),
            # Without swap accounting (no memsw files) the kernel charges no swap.
            swap_usage_bytes=memory.get("total_swap", 0) if memory else None,
            # v1's limit is memory and swap together: the swap part is what exceeds memory's.
            swap_limit_bytes=(
                swap_limit - limit
                if swap_limit is not None and limit is not None and swap_limit < _V1_UNLIMITED
                else None
            ),
            memory_limit_bytes=limit if limit is not None and limit < _V1_UNLIMITED else None,
            process_count=read_int(self.root / "pids" / relative / "pids.current"),
        )

    def oom_kills(self, group: str) -> int:
        control = self.root / "memory" / group.lstrip("/") / "memory.oom_control"
        return read_flat_keyed(control).get("oom_kill", 0)

    def directories(self, group: str) -> list[Path]:
        try:
            return [hierarchy / group.lstrip("/") for hierarchy in self.root.iterdir()]
        except FileNotFoundError:
            return []  # no cgroup file system here

    def _add_figures(self, relative: str, figures: CgroupFigures) -> None:
        read_v1_figures(self.root, relative, figures)


class CgroupV2(CgroupLayout):
    v2 = True

    def stats(self, group: str) -> CgroupStats:
        directory = self.root / group.lstrip("/")
        now = time.time_ns()
        cpu = read_flat_keyed(directory / "cpu.stat")
        memory = read_flat_keyed(directory / "memory.stat")
        usage = read_int(directory / "memory.current")
        usage_usec = cpu.get("usage_usec")
        return CgroupStats(
            timestamp_ns=now,
            cpu_usage_ns=usage_usec * 1000 if usage_usec is not None else None,
            memory_usage_bytes=usage,
            memory_working_set_bytes=working_set(usage, memory.get("inactive_file")),
            memory_rss_bytes=memory.get("anon"),
            page_faults=memory.get("pgfault"),
            major_page_faults=memory.get("pgmajfault"),
            swap_usage_bytes=read_int(directory / "memory.swap.current"),
            swap_limit_bytes=read_int(directory / "memory.swap.max"),  # "max": None
            memory_limit_bytes=read_int(directory / "memory.max"),  # "max": None
            process_count=read_int(directory / "pids.current"),
            pressure={
                resource: stall
                for resource in ("cpu", "memory", "io")
                if (stall := read_pressure(directory / f"{resource}.pressure")) is not None
            },
        )

    def oom_kills(self, group: str) -> int:
        return read_flat_keyed(self.oom_events_file(group)).get("oom_kill", 0)

    def oom_events_file(self, group: str) -> Path:
        return self.root / group.lstrip("/") / "memory.events"

    def directories(self, group: str) -> list[Path]:
        return [self.root / group.lstrip("/")]

    def _add_figures(self, relative: str, figures: CgroupFigures) -> None:
        read_v2_figures(self.root / relative, figures)


def read_pressure(path: Path) -> PressureStall | None:
    """A PSI file: `some avg10=0.12 avg60=… avg300=… total=<µs>` and a `full` line
    (cpu.pressure's `full` is all zeros before Linux 5.13)."""
    try:
        text = read_small_file(path).decode()
    except (OSError, UnicodeDecodeError):
        return None
    lines: dict[str, tuple[int, float, float, float]] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        values = dict(pair.partition("=")[::2] for pair in pairs)
        try:
            lines[kind] = (
                int(values["total"]),
                float(values["avg10"]),
                float(values["avg60"]),
                float(values["avg300"]),
            )
        except (KeyError, ValueError):
            continue
    if "some" not in lines:
        return None
    return PressureStall(some=lines["some"], full=lines.get("full"))


def working_set(usage: int | None, inactive_file: int | None) -> int | None:
    """Usage minus inactive file cache, as kubelet counts it (never negative)."""
    if usage is None:
        return None
    return max(0, usage - (inactive_file or 0))


def cgroup_layout(root: Path = CGROUP_ROOT, *, v2: bool | None = None) -> CgroupLayout:
    """The layout of the hierarchy at `root` (v2 where it has cgroup.controllers), or the
    one named by `v2`."""
    if v2 is None:
        v2 = (root / "cgroup.controllers").exists()
    return _layout(root, v2)


@cache
def _layout(root: Path, v2: bool) -> CgroupLayout:
    return CgroupV2(root) if v2 else CgroupV1(root)
