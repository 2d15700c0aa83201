"""What the runtime side of a node costs, for the benchmarks: its CPU time and its memory.

CPU is read from a cgroup of its own that the runtime's daemon is moved into (cgroup v1's
cpuacct hierarchy, or the unified tree on cgroup v2), so that every helper it starts and
every child it reaps is counted, and nothing else; a single process's from /proc/PID/stat
(its own time and that of the children it reaped). Memory is the proportional set size of
the processes that make up the runtime, as the kernel counts it (`pss_mib`) and with the
runtime alone on the node (`alone_pss`).
"""

from __future__ import annotations

import collections
import itertools
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


class CpuAccount:
    """A cgroup of its own for the runtime's daemon, for its CPU time: in cgroup v1's
    cpuacct hierarchy, or right below the root of the unified tree on cgroup v2 (where
    every cgroup counts its CPU in `cpu.stat`, whatever controllers it has). Moved in
    before it starts anything, the daemon's helpers (conmon, shims) and the children it
    reaps (runc, CNI plugins) are born in it and their CPU time stays counted there after
    they exit; a container's processes are moved by runc into the container's cgroup and
    are not, and neither is a helper moved out (conmon, under the systemd driver:
    `moved_out_seconds`)."""

    def __init__(self, name: str, root: Path = CGROUP_FS) -> None:
        v2 = (root / "cgroup.controllers").exists()
        self.path = root / name if v2 else root / "cpuacct" / name
        self.path.mkdir(exist_ok=True)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def seconds(self) -> float:
        return cgroup_cpu_seconds(self.path)

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        """Processes still in it go back to the root cgroup first."""
        for pid in self.pids():
            try:
                (self.path.parent / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it exited meanwhile
        try:
            self.path.rmdir()
        except OSError:
            time.sleep(0.5)  # a process that was exiting has just gone
            self.path.rmdir()


def cgroup_cpu_seconds(path: Path) -> float:
    """The CPU time of everything that ran in a cgroup and below it: cgroup v1's
    `cpuacct.usage` (ns), or cgroup v2's `usage_usec` in `cpu.stat`."""
    usage = path / "cpuacct.usage"
    if usage.exists():
        return int(usage.read_text()) / 1e9
    for line in (path / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise ValueError(f"no usage_usec in {path / 'cpu.stat'}")


def unified_cgroup(pid: int, root: Path = CGROUP_FS) -> Path | None:
    """The process's cgroup in the unified (v2) tree, or None for a process gone or a host
    without one mounted at `root` (cgroup v1)."""
    if not (root / "cgroup.controllers").exists():
        return None
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def moved_out_seconds(account: CpuAccount, pids: list[int], root: Path = CGROUP_FS) -> float:
    """The CPU time of the cgroups these helpers of the runtime were moved to, out of its
    account (each cgroup once): conmon's transient scope under the systemd driver, which
    conmon entered once it had made its container, its time before that being the
    account's. A helper that exits takes its scope's time with it: only a span in which
    none exits is measured right."""
    found = {unified_cgroup(pid, root) for pid in pids} - {None, account.path}
    total = 0.0
    for path in found:
        assert path is not None
        try:
            total += cgroup_cpu_seconds(path)
        except FileNotFoundError:
            pass  # the scope went with its conmon meanwhile
    return total


def pss_mib(pid: int) -> float:
    """The process's proportional set size: its pages, shared ones divided among sharers."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0.0


PAGE = os.sysconf("SC_PAGE_SIZE")
PFN_MASK = (1 << 55) - 1
# Where the distribution's shared libraries are: the C library, OpenSSL, SQLite, libstdc++,
# which a node's other processes (systemd, journald, a containerd) map too.
SYSTEM_LIBRARIES = ("/usr/lib/", "/lib/", "/lib64/", "/usr/lib64/")


def resident_pages(pid: int) -> list[tuple[int, str]]:
    """(page frame number, mapped file or "" for anonymous memory) of each of the process's
    resident pages, from /proc/PID/maps and /proc/PID/pagemap (frame numbers need root)."""
    found: list[tuple[int, str]] = []
    try:
        with (
            open(f"/proc/{pid}/maps") as maps,
            open(f"/proc/{pid}/pagemap", "rb") as pagemap,
        ):
            for line in maps:
                fields = line.split(maxsplit=5)
                name = fields[5].strip() if len(fields) > 5 else ""
                if name == "[vsyscall]":
                    continue  # not in the page tables
                start, end = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(start // PAGE * 8)
                entries = pagemap.read((end - start) // PAGE * 8)
                found.extend(
                    (entry & PFN_MASK, name)
                    for (entry,) in struct.iter_unpack("<Q", entries)
                    if entry >> 63  # present (a swapped page is not in PSS either)
                )
    except (FileNotFoundError, ProcessLookupError):
        return []  # it exited while we looked
    return found


@dataclass
class AloneShare:
    """A process's share of the pages its runtime maps, each page divided only among the
    runtime's processes that map it (MiB), and the part of it in system libraries."""

    mib: float = 0.0
    system_libraries_mib: float = 0.0


def alone_pss(pids: list[int]) -> dict[int, AloneShare]:
    """The PSS each of `pids` would have if the runtime they make up were alone on the node:
    every resident page divided among the processes of `pids` that map it, and no others.

    The kernel's PSS divides a shared page among every process that maps it: a benchmark's
    own Python process that imported grpc and protobuf, or another Python process of the
    same interpreter (libpython is a shared library), takes part of the daemon's pages and
    makes it look smaller than on a node where the daemon is the only one. Here nothing
    outside the runtime counts. The pages of system libraries (libc, OpenSSL, SQLite,
    libstdc++), which a node's other processes map too, are given apart: with those, the
    figure is what the runtime costs at most; a node's other processes take a part of that
    part."""
    pages = {pid: resident_pages(pid) for pid in pids}
    mappers = collections.Counter(frame for found in pages.values() for frame, _ in found)
    shares = {}
    for pid, found in pages.items():
        share = AloneShare()
        for frame, name in found:
            mib = PAGE / mappers[frame] / 2**20
            share.mib += mib
            if name.startswith(SYSTEM_LIBRARIES):
                share.system_libraries_mib += mib
        shares[pid] = share
    return shares


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def each_process(name: str) -> Iterator[tuple[int, bytes]]:
    """(pid, the contents of /proc/PID/<name>) of every process still there."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / name).read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue


def children(pids: set[int]) -> list[int]:
    """The processes whose parent is one of `pids`."""
    # The command may hold spaces and parentheses: the fields follow the last ')'.
    return [
        pid
        for pid, stat in each_process("stat")
        if int(stat.rpartition(b")")[2].split()[1]) in pids
    ]


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """(its own CPU seconds, those of the children it has reaped), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) / ticks
    reaped = (int(fields[13]) + int(fields[14])) / ticks
    return own, reaped


def command_lines() -> dict[int, list[str]]:
    """Every process's argv, by pid (empty for a kernel thread)."""
    return {
        pid: raw.decode(errors="replace").split("\0")[:-1] for pid, raw in each_process("cmdline")
    }


def gvisor_sandbox_processes(
    argvs: dict[int, list[str]], runsc_root: Path, waiter_script: Path
) -> dict[int, str]:
    """The host processes of a cri-shim's gVisor pods, by pid, with their kind: the
    Sentry (`runsc-sandbox`), the gofers (`runsc-gofer`), both under this runsc state root;
    and the waiters conmon waits for (the background shell of the daemon's
    runsc-under-conmon script and the `runsc wait` it runs)."""
    root = str(runsc_root)
    kinds = {}
    for pid, argv in argvs.items():
        if not argv:
            continue
        ours = f"--root={root}" in argv or any(
            a == "--root" and b == root for a, b in itertools.pairwise(argv)
        )
        if argv[0] == "runsc-sandbox" and ours:
            kinds[pid] = "sandbox"
        elif argv[0] == "runsc-gofer" and ours:
            kinds[pid] = "gofer"
        elif len(argv) > 1 and argv[1] == str(waiter_script):
            kinds[pid] = "waiter"
        elif ours and "wait" in argv[1:]:
            kinds[pid] = "waiter"
    return kinds


class Profiler:
    """py-spy recording the daemon (raw collapsed stacks) for one phase. `native` adds the
    C frames (the extensions' and the syscalls'), for which py-spy pauses the process at
    each sample rather than reading it as it runs."""

    def __init__(self, pid: int, out: Path, *, native: bool = False, rate: int = 100) -> None:
        self.out = out
        py_spy = Path(sys.executable).parent / "py-spy"
        self.proc = subprocess.Popen(
            [
                str(py_spy),
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--output",
                str(out),
                "--native" if native else "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def finish(self) -> dict[str, int]:
        """Stop it (SIGINT: it writes what it has) and read the samples by stack."""
        self.proc.send_signal(2)
        self.proc.wait(60)
        stacks: dict[str, int] = {}
        if self.out.exists():
            for line in self.out.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                stacks[stack] = stacks.get(stack, 0) + int(count)
        return stacks
