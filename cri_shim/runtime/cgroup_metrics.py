"""The cAdvisor-style figures of one container's cgroup, from cgroup v1 or v2 files.

runtime/cgroup_layout.py reads what ContainerStats needs, and with these readers (one
per layout) the wider set that kubelet's /metrics/cadvisor shows when it takes metrics
from the runtime (ListPodSandboxMetrics): CPU split into user and system time and CFS
throttling, memory usage, working set, RSS, cache, mapped files, kernel memory, swap,
peak, limit, failures and page faults, OOM kills, block I/O per device, the cgroup's CPU
and swap settings, and the number of processes, threads (and their limit), file
descriptors and sockets. A file that does not exist (a controller not mounted, the
container gone) leaves its figure out: no guessed zero. Two figures follow cAdvisor where
the kernel has nothing to read: swap is 0 where the kernel keeps no swap account, and a
thread limit of "max" is 0 (no limit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cri_shim.runtime.stats import read_flat_keyed, read_int

# cgroup v1 mounts cpuacct alone or together with cpu, depending on the distribution.
_CPUACCT = ("cpuacct", "cpu,cpuacct", "cpuacct,cpu")
_CPU = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
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
    threads_max: int | None = None
    cpu_periods: int | None = None
    cpu_throttled_periods: int | None = None
    cpu_throttled_ns: int | None = None
    cpu_period_us: int | None = None  # the CFS period the cgroup is set to
    cpu_shares: int | None = None
    memory_failcnt: int | None = None
    memory_kernel_bytes: int | None = None
    memory_mapped_file_bytes: int | None = None
    memory_swap_bytes: int | None = None
    memory_swap_limit_bytes: int | None = None
    # (fault type, scope) -> count; scope "container" is the cgroup alone, "hierarchy"
    # includes its children (v2 counts hierarchically only).
    page_faults: dict[tuple[str, str], int] = field(default_factory=dict)
    # (major, minor) -> operation ("Read", "Write", ...) -> bytes, and -> operations.
    io_bytes: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    io_ops: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


def read_v2_figures(group: Path, figures: CgroupFigures) -> None:
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
    # crun under systemd's driver runs the container in a `container` child of its scope:
    # the members are the subtree's, as every other v2 figure is.
    members = _subtree(group)
    figures.processes = _count_lines_in(members, "cgroup.procs")
    figures.threads = _count_lines_in(members, "cgroup.threads")
    figures.threads_max = _limit(group / "pids.max")
    figures.cpu_periods = cpu.get("nr_periods")
    figures.cpu_throttled_periods = cpu.get("nr_throttled")
    if "throttled_usec" in cpu:
        figures.cpu_throttled_ns = cpu["throttled_usec"] * 1000
    cpu_max = _read_words(group / "cpu.max")
    if len(cpu_max) == 2 and cpu_max[1].isdigit():
        figures.cpu_period_us = int(cpu_max[1])
    weight = read_int(group / "cpu.weight")
    if weight is not None:  # the inverse of the shares-to-weight mapping runc applies
        figures.cpu_shares = 2 + ((weight - 1) * 262142) // 9999
    figures.memory_failcnt = read_flat_keyed(group / "memory.events").get("max")
    figures.memory_kernel_bytes = memory.get("kernel")
    figures.memory_mapped_file_bytes = memory.get("file_mapped")
    figures.memory_swap_bytes = read_int(group / "memory.swap.current")
    figures.memory_swap_limit_bytes = read_int(group / "memory.swap.max")
    for fault in ("pgfault", "pgmajfault"):
        if fault in memory:
            for scope in ("container", "hierarchy"):
                figures.page_faults[(fault, scope)] = memory[fault]
    _read_io_stat(group / "io.stat", figures)
    figures.pids = [pid for member in members for pid in _pids(member / "cgroup.procs")]


def read_v1_figures(root: Path, relative: str, figures: CgroupFigures) -> None:
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
            figures.pids = _pids(group / "cgroup.procs")
            break
    figures.threads_max = _limit(root / "pids" / relative / "pids.max")
    for mount in _CPU:
        cpu = read_flat_keyed(root / mount / relative / "cpu.stat")
        if cpu:
            figures.cpu_periods = cpu.get("nr_periods")
            figures.cpu_throttled_periods = cpu.get("nr_throttled")
            figures.cpu_throttled_ns = cpu.get("throttled_time")
            figures.cpu_period_us = read_int(root / mount / relative / "cpu.cfs_period_us")
            figures.cpu_shares = read_int(root / mount / relative / "cpu.shares")
            break
    figures.memory_failcnt = read_int(memory_dir / "memory.failcnt")
    figures.memory_kernel_bytes = read_int(memory_dir / "memory.kmem.usage_in_bytes")
    figures.memory_mapped_file_bytes = memory.get("total_mapped_file")
    if memory:
        # Without swap accounting (no memory.memsw files) the kernel charges no swap.
        figures.memory_swap_bytes = memory.get("total_swap", 0)
    swap_limit = read_int(memory_dir / "memory.memsw.limit_in_bytes")
    if swap_limit is not None and swap_limit < _V1_UNLIMITED:
        figures.memory_swap_limit_bytes = swap_limit
    for fault in ("pgfault", "pgmajfault"):
        if fault in memory:
            figures.page_faults[(fault, "container")] = memory[fault]
        if f"total_{fault}" in memory:
            figures.page_faults[(fault, "hierarchy")] = memory[f"total_{fault}"]
    blkio = root / "blkio" / relative
    _read_blkio(blkio / "blkio.throttle.io_service_bytes_recursive", figures.io_bytes)
    _read_blkio(blkio / "blkio.throttle.io_serviced_recursive", figures.io_ops)


def _read_blkio(path: Path, into: dict[tuple[int, int], dict[str, int]]) -> None:
    """v1's `MAJ:MIN Operation value` lines (and a final `Total value`)."""
    for words in _lines_of_words(path):
        if len(words) != 3 or ":" not in words[0]:
            continue
        device = _device_number(words[0])
        if device is not None and words[2].isdigit():
            into.setdefault(device, {})[words[1]] = int(words[2])


_IO_STAT_KEYS = {"rbytes": "Read", "wbytes": "Write", "dbytes": "Discard"}
_IO_STAT_OPS = {"rios": "Read", "wios": "Write", "dios": "Discard"}


def _read_io_stat(path: Path, figures: CgroupFigures) -> None:
    """v2's `MAJ:MIN rbytes=… wbytes=… rios=… wios=… dbytes=… dios=…` lines."""
    for words in _lines_of_words(path):
        device = _device_number(words[0]) if words else None
        if device is None:
            continue
        for pair in words[1:]:
            key, _, value = pair.partition("=")
            if not value.isdigit():
                continue
            if key in _IO_STAT_KEYS:
                figures.io_bytes.setdefault(device, {})[_IO_STAT_KEYS[key]] = int(value)
            elif key in _IO_STAT_OPS:
                figures.io_ops.setdefault(device, {})[_IO_STAT_OPS[key]] = int(value)


def _device_number(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(":")
    if major.isdigit() and minor.isdigit():
        return int(major), int(minor)
    return None


def block_device_name(major: int, minor: int) -> str:
    """`/dev/vda` for 254:0, from sysfs; the numbers themselves where sysfs has no name."""
    try:
        for line in Path(f"/sys/dev/block/{major}:{minor}/uevent").read_text().splitlines():
            if line.startswith("DEVNAME="):
                return "/dev/" + line.removeprefix("DEVNAME=")
    except OSError:
        pass
    return f"{major}:{minor}"


def count_descriptors(pids: list[int]) -> tuple[int, int]:
    """Open file descriptors of these processes, and how many of them are sockets."""
    files = sockets = 0
    for pid in pids:
        try:
            entries = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # the process has gone
        files += len(entries)
        for entry in entries:
            try:
                if os.readlink(f"/proc/{pid}/fd/{entry}").startswith("socket:"):
                    sockets += 1
            except OSError:
                continue
    return files, sockets


def _lines_of_words(path: Path) -> list[list[str]]:
    try:
        return [line.split() for line in path.read_text().splitlines()]
    except OSError:
        return []


def _read_words(path: Path) -> list[str]:
    lines = _lines_of_words(path)
    return lines[0] if lines else []


def _limit(path: Path) -> int | None:
    """A limit file: its number, 0 for "max" (no limit, as cAdvisor reports it)."""
    words = _read_words(path)
    if not words:
        return None
    return 0 if words[0] == "max" else int(words[0]) if words[0].isdigit() else None


def _pids(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split() if line.isdigit()]
    except OSError:
        return []


def _subtree(group: Path) -> list[Path]:
    """A v2 cgroup and the cgroups below it."""
    return [Path(directory) for directory, _, _ in os.walk(group)] or [group]


def _count_lines_in(groups: list[Path], name: str) -> int | None:
    counts = [count for g in groups if (count := _count_lines(g / name)) is not None]
    return sum(counts) if counts else None


def _count_lines(path: Path) -> int | None:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return None
