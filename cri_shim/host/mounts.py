"""Host mounts through mount(2)/umount2(2) directly (no `mount` process per call), and
what /proc/self/mountinfo says is mounted."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from cri_shim.host.libc import check, last_errno, libc

log = logging.getLogger(__name__)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_UNBINDABLE = 1 << 17
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MNT_DETACH = 2


def mount(
    source: str | None, target: Path, fstype: str | None, flags: int = 0, data: str = ""
) -> None:
    """mount(2); `source` None for a change of propagation. Raises OSError naming both."""
    check(
        libc.mount(
            source.encode() if source is not None else None,
            os.fsencode(target),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source or 'none'} on {target} ({fstype or 'bind'})",
    )


def mount_tmpfs(target: Path, *, size: int, mode: int = 0o755) -> None:
    mount("shm", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"mode={mode:o},size={size}")


def detach(target: Path) -> bool:
    """Lazily unmount the top mount at `target` (MNT_DETACH, so that a process still inside
    cannot make a teardown fail). False when there was none: not a mount point (any more),
    or gone."""
    if libc.umount2(os.fsencode(target), MNT_DETACH) == 0:
        return True
    err = last_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return False
    raise OSError(err, f"umount {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    """Detach whatever is mounted at `target` (all stacked mounts); nothing mounted is fine."""
    while detach(target):
        pass


def unmount_severed(target: Path) -> None:
    """Detach whatever is mounted at `target`, as `unmount` does, each mount first made a
    slave with everything below it (MS_SLAVE | MS_REC): the unmount of a shared copy
    propagates to its peers, those it was copied from included, and a slave passes
    nothing back to its master. Nothing mounted is fine."""
    while True:
        try:
            mount(None, target, None, MS_SLAVE | MS_REC)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
                return
            raise
        if not detach(target):
            return


def unescape_mountinfo(field: str) -> str:
    """A path as mountinfo writes it, with space, tab, newline and backslash as \\ooo
    octal, turned back into the path."""
    if "\\" not in field:
        return field  # nearly every line: mountinfo is read whole for each question
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


def _mountinfo() -> list[list[str]]:
    with open("/proc/self/mountinfo", errors="surrogateescape") as mountinfo:
        return [line.split(" ") for line in mountinfo if line.strip()]


def mounted(targets: Iterable[Path]) -> set[Path]:
    """Those of `targets` that are mount points, as given or with symlinks resolved.
    mountinfo is read once for all of them: a node's restore asks of every pod, and
    mountinfo lists a few mounts per pod, so one read per question grew with the square."""
    points = {unescape_mountinfo(fields[4]) for fields in _mountinfo()}
    return {t for t in targets if str(t) in points or os.path.realpath(t) in points}


def propagation(path: Path) -> str | None:
    """The optional fields (`shared:N`, `master:N`) of the top mount at exactly `path`, or
    None if it is not a mount point."""
    found: str | None = None
    for fields in _mountinfo():
        if unescape_mountinfo(fields[4]) == str(path):
            # The last entry wins: it is the mount on top, the one lookups see.
            found = " ".join(fields[6 : fields.index("-")])
    return found


def unmount_below(root: Path) -> None:
    """Unmount everything at or below `root`, deepest first. mountinfo is read once and
    compared as strings: on a node with hundreds of pods it has thousands of lines, and
    every container and pod removal asks."""
    top = os.path.realpath(root)
    inside = top.rstrip("/") + "/"
    below = {
        point
        for point in (unescape_mountinfo(fields[4]) for fields in _mountinfo())
        if point == top or point.startswith(inside)
    }
    for point in sorted(below, key=lambda p: p.count("/"), reverse=True):
        unmount(Path(point))


# How long a removal waits before it tries again a tree that something wrote into (or held
# a mount in) while it was being removed.
REMOVE_RETRY_DELAY = 0.5


def remove_tree(root: Path) -> bool:
    """Remove the directory `root` and everything in it, its mounts unmounted first (a
    mount left inside would make the removal delete a live filesystem's files). A tree a
    late writer put something in meanwhile (a monitor's file, a runtime's pid file) is
    tried once more; what is still there after that is logged, with why, rather than left
    silently. Whether `root` is gone."""
    failures: list[str] = []

    def failed(_function: object, path: str, exc: tuple[object, BaseException, object]) -> None:
        failures.append(f"{path}: {exc[1]}")

    for attempt in range(2):
        unmount_below(root)
        failures.clear()
        shutil.rmtree(root, onerror=failed)
        if not os.path.lexists(root):
            return True
        if attempt == 0:
            time.sleep(REMOVE_RETRY_DELAY)
    log.warning("%s could not be removed: %s", root, "; ".join(failures) or "written into again")
    return False
