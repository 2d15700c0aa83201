"""Container root filesystems: overlayfs mounts made with mount(2) through ctypes.

A subprocess per mount would cost a millisecond and an extra failure mode; the syscall is
one call. The kernel takes the mount options as one page (4096 bytes here). An image
with many layers under a long state root can exceed that, so long option strings are
retried with each lower directory named by an open fd (`/proc/self/fd/N`, about 18
bytes each) rather than by its path: no chdir (process-wide, unsafe in a threaded daemon)
and no symlink farm to clean up. Past that, the mount fails with a message that says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from cri_shim.errors import Internal, InvalidArgument
from cri_shim.mounts import is_mounted as is_mounted  # re-exported for callers of unmount
from cri_shim.mounts import mount_points as mount_points
from cri_shim.runtime.userns import idmapped_layers

MS_RDONLY = 0x1
MNT_DETACH = 0x2
# The mount data argument is copied into a single page by the kernel.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# The kernel's limit on stacked lower layers (OVL_MAX_STACK).
MAX_LOWER_DIRS = 500

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str, target: Path, fstype: str, flags: int, data: str) -> None:
    result = _libc.mount(
        source.encode(), os.fsencode(target), fstype.encode(), flags, data.encode()
    )
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def _check_path(path: Path, what: str) -> str:
    text = os.fspath(path)
    # overlayfs splits its options on ',' and lowerdir on ':'; such paths cannot be named.
    if "," in text or ":" in text:
        raise InvalidArgument(f"{what} {text!r} contains ',' or ':', which overlayfs cannot take")
    if not path.is_absolute():
        raise InvalidArgument(f"{what} {text!r} is not an absolute path")
    return text


def _index_off() -> str:
    # With index=on (a kernel default on some distributions), an upper dir is tied to
    # the lower layers it was first mounted with, and sharing layers between containers
    # breaks; containerd turns it off for the same reason.
    return ",index=off" if Path("/sys/module/overlay/parameters/index").exists() else ""


@contextlib.contextmanager
def _lower_fds(lower_dirs: list[Path]) -> Iterator[list[str]]:
    fds: list[int] = []
    try:
        for lower in lower_dirs:
            fds.append(os.open(lower, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        yield [f"/proc/self/fd/{fd}" for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def overlay_options(lower: list[str], upper: str, work: str) -> str:
    return f"lowerdir={':'.join(lower)},upperdir={upper},workdir={work}{_index_off()}"


def mount_rootfs(
    lower_dirs: list[Path],
    upper: Path,
    work: Path,
    target: Path,
    readonly: bool = False,
) -> None:
    """Mount an overlay of `lower_dirs` (top layer first, as `ImageStore.lower_dirs` gives
    them) with `upper` and `work` (created when missing; same filesystem) on `target`.
    `readonly` mounts it read-only (readOnlyRootFilesystem)."""
    if not lower_dirs:
        raise InvalidArgument("cannot mount a root filesystem without layers")
    if len(lower_dirs) > MAX_LOWER_DIRS:
        raise InvalidArgument(
            f"image has {len(lower_dirs)} layers; overlayfs stacks at most {MAX_LOWER_DIRS}"
        )
    lowers = [_check_path(p, "layer directory") for p in lower_dirs]
    upper_text = _check_path(upper, "upper directory")
    work_text = _check_path(work, "work directory")
    _check_path(target, "mount target")
    for directory in (upper, work, target):
        directory.mkdir(parents=True, exist_ok=True)
    flags = MS_RDONLY if readonly else 0

    options = overlay_options(lowers, upper_text, work_text)
    try:
        if len(options) < PAGE_SIZE:
            _mount("overlay", target, "overlay", flags, options)
            return
        with _lower_fds(lower_dirs) as fd_paths:
            options = overlay_options(fd_paths, upper_text, work_text)
            if len(options) >= PAGE_SIZE:
                raise InvalidArgument(
                    f"overlay options for {len(lower_dirs)} layers are {len(options)} bytes even "
                    f"with fd paths; the kernel takes at most {PAGE_SIZE - 1}"
                )
            _mount("overlay", target, "overlay", flags, options)
    except OSError as exc:
        raise Internal(
            f"mount overlay on {target} ({len(lower_dirs)} layers, options {len(options)} "
            f"bytes): {exc.strerror}; the kernel log (dmesg) says why"
        ) from exc


def mount_idmapped_rootfs(
    lower_dirs: list[Path],
    upper: Path,
    work: Path,
    target: Path,
    *,
    userns_path: Path,
    root_owner: tuple[int, int],
    staging: Path,
) -> None:
    """mount_rootfs for a pod with its own user namespace: the layers are idmapped
    through `userns_path` (staged under `staging` only while the overlay is mounted) and
    the upper directory belongs to `root_owner`, the host uid and gid of the pod's root,
    so the container's root owns its root filesystem and what it writes there lands as
    that host id."""
    upper.mkdir(parents=True, exist_ok=True)
    os.chown(upper, *root_owner)
    with idmapped_layers(lower_dirs, userns_path, staging) as points:
        mount_rootfs(points, upper, work, target)


def unmount(target: Path) -> None:
    """Detach whatever is mounted on `target`; nothing mounted is not an error. Lazy
    (MNT_DETACH) so that a process still inside cannot make the teardown fail."""
    path = os.fsencode(target)
    for _attempt in range(8):  # stacked mounts come off one at a time
        if _libc.umount2(path, MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                return  # not a mount point (any more), or gone
            raise Internal(f"unmount {target}: {os.strerror(err)}")
        if not is_mounted(target):
            return
    raise Internal(f"unmount {target}: still mounted after 8 unmounts (mounts stacked there?)")
