"""The cAdvisor-style figures of one container's cgroup, from cgroup v1 or v2 files.

runtime/stats.py reads what ContainerStats needs; this reads the wider set that kubelet's
/metrics/cadvisor shows when it takes metrics from the runtime (ListPodSandboxMetrics):
CPU split into user and system time, memory usage, working set, RSS, cache, peak and
limit, OOM kills, and the number of processes and threads. A file that does not exist
(a controller not mounted, the container gone) leaves its figure out: no guessed zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cri_shim.runtime.stats import read_cgroup_stats, read_flat_keyed, read_int

# cgroup v1 mounts cpuacct alone or together with cpu, depending on the distribution.
_CPUACCT = ("cpuacct", "cpu,cpuacct", "cpuacct,cpu")
# v1's "no limit" is the largest page-aligned 64-bit value; reported as no limit.
_V1_UNLIMITED = 1 << 62


@dataclass
class CgroupFigures:
    """Every value is optional; see the module docstring."""

    cpu_usage_ns: int | None = None
    cpu_user_ns: int | None = None
    cpu_system_ns: int | None = None
    memory_usage_bytes: int | None = None
    memory_working_set_bytes: int | None = None
    memory_rss_bytes: int | None = None
    memory_cache_bytes: int | None = None
    memory_max_usage_bytes: int | None = None
    memory_limit_bytes: int | None = None
    oom_kills: int | None = None
    processes: int | None = None
    threads: int | None = None


def read_cgroup_figures(
    cgroups_path: str, cgroup_root: Path = Path("/sys/fs/cgroup"), *, cgroup_v2: bool
) -> CgroupFigures:
    base = read_cgroup_stats(cgroups_path, cgroup_root, cgroup_v2=cgroup_v2)
    figures = CgroupFigures(
        cpu_usage_ns=base.cpu_usage_ns,
        memory_usage_bytes=base.memory_usage_bytes,
        memory_working_set_bytes=base.memory_working_set_bytes,
        memory_rss_bytes=base.memory_rss_bytes,
    )
    relative = cgroups_path.lstrip("/")
    if cgroup_v2:
        _read_v2(cgroup_root / relative, figures)
    else:
        _read_v1(cgroup_root, relative, figures)
    return figures


def _read_v2(group: Path, figures: CgroupFigures) -> None:
    cpu = read_flat_keyed(group / "cpu.stat")
    if "user_usec" in cpu:
        figures.cpu_user_ns = cpu["user_usec"] * 1000
    if "system_usec" in cpu:
        figures.cpu_system_ns = cpu["system_usec"] * 1000
    memory = read_flat_keyed(group / "memory.stat")
    figures.memory_cache_bytes = memory.get("file")
    figures.memory_max_usage_bytes = read_int(group / "memory.peak")
    figures.memory_limit_bytes = read_int(group / "memory.max")  # "max" reads as None
    figures.oom_kills = read_flat_keyed(group / "memory.events").get("oom_kill")
    figures.processes = _count_lines(group / "cgroup.procs")
    figures.threads = _count_lines(group / "cgroup.threads")


def _read_v1(root: Path, relative: str, figures: CgroupFigures) -> None:
    for mount in _CPUACCT:
        user = read_int(root / mount / relative / "cpuacct.usage_user")
        if user is not None:
            figures.cpu_user_ns = user
            figures.cpu_system_ns = read_int(root / mount / relative / "cpuacct.usage_sys")
            break
    memory_dir = root / "memory" / relative
    memory = read_flat_keyed(memory_dir / "memory.stat")
    figures.memory_cache_bytes = memory.get("total_cache")
    figures.memory_max_usage_bytes = read_int(memory_dir / "memory.max_usage_in_bytes")
    limit = read_int(memory_dir / "memory.limit_in_bytes")
    figures.memory_limit_bytes = limit if limit is not None and limit < _V1_UNLIMITED else None
    figures.oom_kills = read_flat_keyed(memory_dir / "memory.oom_control").get("oom_kill")
    # Any v1 hierarchy lists the members; pids is always mounted where containers run.
    for controller in ("pids", "memory"):
        group = root / controller / relative
        processes = _count_lines(group / "cgroup.procs")
        if processes is not None:
            figures.processes = processes
            figures.threads = _count_lines(group / "tasks")
            break


def _count_lines(path: Path) -> int | None:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return None
