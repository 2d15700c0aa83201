"""Bind-mount sources resolved once: a host path swapped between the check and
the mount cannot redirect the mount.

A request's `mounts[i].host_path` is checked when the request is validated, and runc
resolves it again, by path, when it makes the container's mounts. Whoever can change a
directory on that path in between (a symlink swapped in, a directory renamed) would
choose what the container gets, e.g. the host's `/`. So the path is opened once, here,
following symlinks as kubelet expects (a host path may itself be a link), and what was
opened is bind-mounted through its descriptor (`/proc/self/fd/N`, which the kernel
resolves to the opened object, not to a path) onto a staging point in the container's
bundle directory, which only root can write to. runc is given the staging point. Once
runc has created the container (its mounts exist in the container's namespace), the
staging mounts are detached; if the daemon dies in between, the bundle directory's undo
step releases them (release_staging) before it unmounts everything else below it.

A staging mount must never change what the host has mounted, whatever its source covers.
It is a recursive copy, and the copy of a shared mount is a peer of it: unmounting the copy
(or anything in it) unmounts the original too. A host path of `/` or `/run` covers the
daemon's namespace pins, which are shared mounts (network/netns.py), and on a systemd node
`/dev`, `/proc` and the rest as well: one container mounting `/` unpinned every pod's
namespaces. So each staging mount is made private (rprivate) or a slave (rslave) right
after it is made, as the container's mount asks; a bidirectional one must stay a peer of
the host's until runc has copied it (the container's copy must be one), so it is made a
slave just before it is detached, as runc makes its old root a slave before unmounting it.
A slave receives the host's mount events and passes nothing back.

A host path of `/` copies every mount of the daemon's namespace, and the staging
directories of the containers being created are mounts in it too. So each staging
directory is itself a mount, made unbindable: a recursive bind of `/` (or of anything
above a bundle) leaves out every staging directory and what is staged below it, this
container's others included, instead of nesting copies of them in its own. Being a mount
of its own that is not shared, it also keeps what is staged in it from being propagated
to the mounts the host's `/` shares.

In a pod with a user namespace of its own, every bind mount is staged this way, the
pod's own files (/etc/hosts, /dev/shm, ...) too, and each staging mount is an idmapped
clone (host/idmap.py), so that what the host's root owns the pod's root owns.
Image volumes are the exception: overlayfs cannot be idmapped, so they are stacked from
idmapped layers instead (lifecycle/image_volumes.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.host import mounts
from cri_shim.host.idmap import idmapped_mount, open_userns

log = logging.getLogger(__name__)


@dataclass
class PinnedSources:
    """The staging mounts made for one container; `release` detaches them."""

    staging: Path
    points: list[Path] = field(default_factory=list)

    def release(self) -> None:
        severed = True
        for point in reversed(self.points):
            try:
                mounts.unmount_severed(point)
            except OSError as exc:  # left to the bundle directory's undo step
                log.warning("staging mount %s: %s", point, exc)
                severed = False
                continue
            try:
                point.rmdir() if point.is_dir() else point.unlink()
            except OSError:
                pass
        self.points.clear()
        if not severed:
            # Detaching the staging directory would take a mount not yet severed with it,
            # and its unmount to the mounts it was copied from.
            return
        try:
            mounts.unmount(self.staging)
            self.staging.rmdir()
        except OSError:
            pass


def release_staging(staging: Path) -> None:
    """Release the staging mounts a creation left under `staging` (a bundle's `mounts`
    directory) when its process died before it could: each is severed from the mounts it
    was copied from before it is detached, like `PinnedSources.release`. Call it before
    `mounts.unmount_below` on the bundle, which unmounts what is inside them one by one."""
    try:
        points = sorted(staging.iterdir())
    except FileNotFoundError:
        return
    PinnedSources(staging, points).release()


def _make_staging(staging: Path) -> None:
    """The staging directory, as a mount of its own that cannot be bound (above)."""
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new container's bundle
    mounts.mount(str(staging), staging, None, mounts.MS_BIND)
    mounts.mount(None, staging, None, mounts.MS_UNBINDABLE)


def pin_bind_sources(
    spec: dict[str, Any],
    requested: Sequence[api_pb2.Mount],
    staging: Path,
    userns_path: Path | None = None,
) -> PinnedSources:
    """Replace the source of each bind mount in `spec` that comes from `requested` by a
    staging point under `staging` on which the opened host path is mounted. Raises
    InvalidArgument naming the field when a host path is gone or cannot be opened. With
    `userns_path` (the pod's pinned user namespace), all bind mounts but image volumes
    are staged, idmapped through it."""
    pinned = PinnedSources(staging)
    made = False
    wanted = {
        (mount.container_path, mount.host_path): index
        for index, mount in enumerate(requested)
        if not _is_image_volume(mount)
    }
    image_volumes = {mount.container_path for mount in requested if _is_image_volume(mount)}
    try:
        with contextlib.ExitStack() as stack:
            userns_fd = None
            if userns_path is not None:
                userns_fd = stack.enter_context(open_userns(userns_path))
            for number, entry in enumerate(spec.get("mounts", [])):
                if entry.get("type") != "bind":
                    continue
                destination = entry.get("destination")
                index = wanted.get((destination, entry.get("source")))
                if index is not None:
                    name, field_name = str(index), f"mounts[{index}].host_path"
                elif userns_fd is not None and destination not in image_volumes:
                    name, field_name = f"pod-{number}", f"the pod's mount at {destination}"
                else:
                    continue
                if not made:
                    _make_staging(staging)
                    made = True
                point = _pin(entry["source"], name, field_name, pinned, userns_fd)
                _set_propagation(point, entry.get("options", []))
                entry["source"] = str(point)
    except BaseException:
        pinned.release()
        raise
    return pinned


def _set_propagation(point: Path, options: Sequence[str]) -> None:
    """Cut the staging mount at `point` off from the mounts it copies, as far as the
    container's mount allows: rprivate, or rslave (host mounts made later must still reach
    the container through it). An rshared one stays a peer until it is released."""
    if "rshared" in options:
        return
    flag = mounts.MS_SLAVE if "rslave" in options else mounts.MS_PRIVATE
    mounts.mount(None, point, None, flag | mounts.MS_REC)


def _is_image_volume(mount: api_pb2.Mount) -> bool:
    return mount.HasField("image") and bool(mount.image.image)


def _pin(
    host_path: str, name: str, field_name: str, pinned: PinnedSources, userns_fd: int | None
) -> Path:
    try:
        # O_PATH: no read permission needed and nothing is opened for I/O; symlinks are
        # followed, once, here.
        fd = os.open(host_path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"{field_name}: {host_path}: {exc.strerror}") from None
    try:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        point = pinned.staging / name
        if is_dir:
            point.mkdir(mode=0o700)
        else:
            os.close(os.open(point, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        pinned.points.append(point)
        if userns_fd is not None:
            try:
                idmapped_mount(fd, point, userns_fd)
            except OSError as exc:
                raise FailedPrecondition(
                    f"{field_name}: {host_path} cannot be idmapped for the pod's user "
                    f"namespace: {exc.strerror} (its filesystem must support idmapped mounts)"
                ) from None
            return point
        # MS_REC: what is mounted below the host path comes along, as `rbind` asks.
        mounts.mount(f"/proc/self/fd/{fd}", point, None, mounts.MS_BIND | mounts.MS_REC)
        return point
    finally:
        os.close(fd)
