"""Container statistics: the figures of a container's cgroup (read per layout by
runtime/cgroup_layout.py), the small-file readers they use, and the disk use of its
writable layer. CPU rates, which need the previous sample, are kept by
inspection/cpu_rates.py.

The mapping of CRI resource limits onto the cgroup (used by create and by
UpdateContainerResources) lives in runtime/resources.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CgroupStats:
    timestamp_ns: int
    cpu_usage_ns: int | None  # cumulative CPU time of all processes
    memory_usage_bytes: int | None
    memory_working_set_bytes: int | None  # usage minus inactive file cache, as kubelet counts
    memory_rss_bytes: int | None
    page_faults: int | None
    major_page_faults: int | None
    swap_usage_bytes: int | None = None
    swap_limit_bytes: int | None = None  # None: no limit of its own
    memory_limit_bytes: int | None = None  # None: no limit of its own
    process_count: int | None = None  # the pids controller's count, threads included
    # "cpu", "memory", "io" -> their pressure stall figures (cgroup v2 only).
    pressure: Mapping[str, PressureStall] = field(default_factory=dict)


@dataclass(frozen=True)
class PressureStall:
    """One PSI file: (total µs stalled, avg10, avg60, avg300 in %) of some tasks stalled,
    and of all (`full`, absent where the kernel has no such line)."""

    some: tuple[int, float, float, float]
    full: tuple[int, float, float, float] | None


@dataclass(frozen=True)
class LayerUsage:
    used_bytes: int  # blocks allocated, not apparent sizes: sparse files count as they use
    inodes_used: int


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
