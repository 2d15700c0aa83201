"""Host mounts through mount(2)/umount2(2) directly: no `mount` process per call."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 2


def mount(source: str, target: Path, fstype: str | None, flags: int = 0, data: str = "") -> None:
    if (
        _libc.mount(
            source.encode(),
            str(target).encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype or 'bind'}): {os.strerror(err)}")


def mount_tmpfs(target: Path, *, size: int, mode: int = 0o755) -> None:
    mount("shm", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode={mode:o},size={size}")


def unmount(target: Path) -> None:
    """Detach whatever is mounted at `target` (all stacked mounts); nothing mounted is fine."""
    while is_mounted(target):
        if _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                return
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def unescape_mountinfo(field: str) -> str:
    """A path as mountinfo writes it, with space, tab, newline and backslash as \\ooo
    octal, turned back into the path."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points() -> list[Path]:
    """Every mount point of this mount namespace, in mount order."""
    with open("/proc/self/mountinfo", errors="surrogateescape") as mountinfo:
        return [Path(unescape_mountinfo(line.split(" ")[4])) for line in mountinfo if line.strip()]


def is_mounted(target: Path) -> bool:
    return Path(os.path.realpath(target)) in mount_points() or target in mount_points()


def unmount_below(root: Path) -> None:
    """Unmount everything at or below `root`, deepest first."""
    root = Path(os.path.realpath(root))
    below = [p for p in mount_points() if p == root or root in p.parents]
    for point in sorted(set(below), key=lambda p: len(p.parts), reverse=True):
        unmount(point)
