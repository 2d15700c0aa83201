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
step unmounts everything below it before removing it.

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
        for point in reversed(self.points):
            try:
                mounts.unmount(point)
            except OSError as exc:  # left to the bundle directory's undo step
                log.warning("staging mount %s: %s", point, exc)
                continue
            try:
                point.rmdir() if point.is_dir() else point.unlink()
            except OSError:
                pass
        self.points.clear()
        try:
            self.staging.rmdir()
        except OSError:
            pass


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
                    field_name = f"mounts[{index}].host_path"
                    point = _pin(
                        entry["source"],
                        str(index),
                        field_name,
                        pinned,
                        userns_fd,
                        bidirectional="rshared" in entry.get("options", ()),
                    )
                elif userns_fd is not None and destination not in image_volumes:
                    field_name = f"the pod's mount at {destination}"
                    point = _pin(entry["source"], f"pod-{number}", field_name, pinned, userns_fd)
                else:
                    continue
                entry["source"] = str(point)
    except BaseException:
        pinned.release()
        raise
    return pinned


def _is_image_volume(mount: api_pb2.Mount) -> bool:
    return mount.HasField("image") and bool(mount.image.image)


def _pin(
    host_path: str,
    name: str,
    field_name: str,
    pinned: PinnedSources,
    userns_fd: int | None,
    *,
    bidirectional: bool = False,
) -> Path:
    try:
        # O_PATH: no read permission needed and nothing is opened for I/O; symlinks are
        # followed, once, here.
        fd = os.open(host_path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"{field_name}: {host_path}: {exc.strerror}") from None
    try:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        pinned.staging.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        if not bidirectional:
            # The copy of a shared host path (everything on a node whose `/` systemd made
            # shared) is a peer of it: detaching the staging copy would unmount, on the
            # host, the mounts below the host path. A slave still receives the host's
            # mounts (HostToContainer) and sends nothing back.
            mounts.mount(None, point, None, mounts.MS_SLAVE | mounts.MS_REC)
        return point
    finally:
        os.close(fd)
