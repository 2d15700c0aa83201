"""Container root filesystems: overlayfs mounts made with mount(2).

A subprocess per mount would cost a millisecond and an extra failure mode; the syscall is
one call. The kernel takes the mount options as one page (4096 bytes here). An image
with many layers under a long state root can exceed that, so long option strings are
retried with each lower directory named by an open fd (`/proc/self/fd/N`, about 18
bytes each) rather than by its path: no chdir (process-wide, unsafe in a threaded daemon)
and no symlink farm to clean up. Past that, the mount fails with a message that says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from cri_shim.errors import Internal, InvalidArgument
from cri_shim.host import mounts
from cri_shim.host.idmap import idmapped_layers

# The mount data argument is copied into a single page by the kernel.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# The kernel's limit on stacked lower layers (OVL_MAX_STACK).
MAX_LOWER_DIRS = 500


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
    flags = mounts.MS_RDONLY if readonly else 0

    options = overlay_options(lowers, upper_text, work_text)
    try:
        if len(options) < PAGE_SIZE:
            mounts.mount("overlay", target, "overlay", flags, options)
            return
        with _lower_fds(lower_dirs) as fd_paths:
            options = overlay_options(fd_paths, upper_text, work_text)
            if len(options) >= PAGE_SIZE:
                raise InvalidArgument(
                    f"overlay options for {len(lower_dirs)} layers are {len(options)} bytes even "
                    f"with fd paths; the kernel takes at most {PAGE_SIZE - 1}"
                )
            mounts.mount("overlay", target, "overlay", flags, options)
    except OSError as exc:
        raise Internal(
            f"mount overlay on {target} ({len(lower_dirs)} layers, options {len(options)} "
            f"bytes): {os.strerror(exc.errno or 0)}; the kernel log (dmesg) says why"
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
    # Stacked mounts come off one at a time, until umount2 says nothing is left (asking
    # mountinfo instead reads every mount of the node).
    for _attempt in range(9):
        try:
            if not mounts.detach(target):
                return  # not a mount point (any more), or gone
        except OSError as exc:
            raise Internal(f"unmount {target}: {os.strerror(exc.errno or 0)}") from exc
    raise Internal(f"unmount {target}: still mounted after 9 unmounts (mounts stacked there?)")
