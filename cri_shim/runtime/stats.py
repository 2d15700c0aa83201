"""Container statistics: CPU and memory from the container's cgroup (v1 or v2), and the
disk use of its writable layer. CPU rates, which need the previous sample, are kept by
inspection/cpu_rates.py.

The mapping of CRI resource limits onto the cgroup (used by create and by
UpdateContainerResources) lives in runtime/resources.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 mounts cpuacct alone or together with cpu, depending on the distribution.
_CPUACCT_MOUNTS = ("cpuacct", "cpu,cpuacct", "cpuacct,cpu")


@dataclass(frozen=True)
class CgroupStats:
    timestamp_ns: int
    cpu_usage_ns: int | None  # cumulative CPU time of all processes
    memory_usage_bytes: int | None
    memory_working_set_bytes: int | None  # usage minus inactive file cache, as kubelet counts
    memory_rss_bytes: int | None
    page_faults: int | None
    major_page_faults: int | None


@dataclass(frozen=True)
class LayerUsage:
    used_bytes: int  # blocks allocated, not apparent sizes: sparse files count as they use
    inodes_used: int


def read_cgroup_stats(
    cgroups_path: str, cgroup_root: Path = Path("/sys/fs/cgroup"), *, cgroup_v2: bool | None = None
) -> CgroupStats:
    """Read what exists; a missing file (a controller not mounted, the container already
    deleted) gives None for that value rather than an error."""
    relative = cgroups_path.lstrip("/")
    if cgroup_v2 is None:
        cgroup_v2 = (cgroup_root / "cgroup.controllers").exists()
    now = time.time_ns()
    if cgroup_v2:
        group = cgroup_root / relative
        cpu = read_flat_keyed(group / "cpu.stat")
        memory = read_flat_keyed(group / "memory.stat")
        usage = read_int(group / "memory.current")
        usage_usec = cpu.get("usage_usec")
        return CgroupStats(
            timestamp_ns=now,
            cpu_usage_ns=usage_usec * 1000 if usage_usec is not None else None,
            memory_usage_bytes=usage,
            memory_working_set_bytes=_working_set(usage, memory.get("inactive_file")),
            memory_rss_bytes=memory.get("anon"),
            page_faults=memory.get("pgfault"),
            major_page_faults=memory.get("pgmajfault"),
        )
    cpu_usage = None
    for mount in _CPUACCT_MOUNTS:
        cpu_usage = read_int(cgroup_root / mount / relative / "cpuacct.usage")
        if cpu_usage is not None:
            break
    group = cgroup_root / "memory" / relative
    memory = read_flat_keyed(group / "memory.stat")
    usage = read_int(group / "memory.usage_in_bytes")
    return CgroupStats(
        timestamp_ns=now,
        cpu_usage_ns=cpu_usage,
        memory_usage_bytes=usage,
        # total_* include child cgroups, which is what a container's figure must cover.
        memory_working_set_bytes=_working_set(usage, memory.get("total_inactive_file")),
        memory_rss_bytes=memory.get("total_rss"),
        page_faults=memory.get("total_pgfault"),
        major_page_faults=memory.get("total_pgmajfault"),
    )


def oom_kill_count(
    cgroups_path: str, cgroup_root: Path = Path("/sys/fs/cgroup"), *, cgroup_v2: bool
) -> int:
    """How many processes of the cgroup the kernel's OOM killer killed (kernel >= 4.13
    on v1). Zero when the cgroup is gone."""
    relative = cgroups_path.lstrip("/")
    if cgroup_v2:
        counters = read_flat_keyed(cgroup_root / relative / "memory.events")
    else:
        counters = read_flat_keyed(cgroup_root / "memory" / relative / "memory.oom_control")
    return counters.get("oom_kill", 0)


def writable_layer_usage(upper_dir: Path) -> LayerUsage:
    """Walk the overlay upper directory. Hard links are counted once; the walk does not
    follow symlinks or cross into other filesystems mounted below it."""
    used = 0
    inodes = 0
    seen: set[tuple[int, int]] = set()
    try:
        root_dev = upper_dir.lstat().st_dev
    except FileNotFoundError:
        return LayerUsage(0, 0)
    pending = [str(upper_dir)]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue  # removed or unreadable while walking
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_dev != root_dev:
                continue
            key = (info.st_dev, info.st_ino)
            if key in seen:
                continue
            seen.add(key)
            inodes += 1
            used += info.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
    return LayerUsage(used_bytes=used, inodes_used=inodes)


def _working_set(usage: int | None, inactive_file: int | None) -> int | None:
    if usage is None:
        return None
    return max(0, usage - (inactive_file or 0))


def read_small_file(path: Path) -> bytes:
    """A cgroup or proc file, whole (they are under a page). Raw reads: the stats calls
    read three of these per container, and a text-mode open costs more than the read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 65536)]
        while chunks[-1]:
            chunks.append(os.read(fd, 65536))
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_int(path: Path) -> int | None:
    try:
        return int(read_small_file(path))
    except (OSError, ValueError):
        return None


def read_flat_keyed(path: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        text = read_small_file(path).decode()
    except (OSError, UnicodeDecodeError):
        return values
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            values[key] = int(value)
        except ValueError:
            continue
    return values
