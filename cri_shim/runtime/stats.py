"""Container statistics: CPU and memory from the container's cgroup (v1 or v2), the disk
use of its writable layer, and CPU rates from successive samples.

The mapping of CRI resource limits onto the cgroup (used by create and by
UpdateContainerResources) lives in runtime/resources.py.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Collection
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


# Samples kept for CPU rates; a node runs a few hundred pods at most.
MAX_RATE_SAMPLES = 4096


class CpuRates:
    """`usage_nano_cores` of each pod and container: the CPU time used between its
    previous sample and this one, per second of wall time (kubelet takes the field as is
    when it is set, and computes nothing of its own then). The first sample of an object
    has no rate. At most `max_objects` samples are kept, the least recently sampled going
    first; `retain` drops those of removed objects."""

    def __init__(self, max_objects: int = MAX_RATE_SAMPLES) -> None:
        self._max = max_objects
        self._samples: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._samples)

    def rate(self, object_id: str, timestamp_ns: int, usage_ns: int) -> int | None:
        previous = self._samples.pop(object_id, None)
        self._samples[object_id] = (timestamp_ns, usage_ns)
        while len(self._samples) > self._max:
            self._samples.popitem(last=False)
        if previous is None:
            return None
        elapsed, used = timestamp_ns - previous[0], usage_ns - previous[1]
        if elapsed <= 0 or used < 0:  # the same instant, or a container of the pod gone
            return None
        return used * 1_000_000_000 // elapsed

    def retain(self, live: Collection[str]) -> None:
        for object_id in [o for o in self._samples if o not in live]:
            del self._samples[object_id]


def _working_set(usage: int | None, inactive_file: int | None) -> int | None:
    if usage is None:
        return None
    return max(0, usage - (inactive_file or 0))


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_flat_keyed(path: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            values[key] = int(value)
        except ValueError:
            continue
    return values
