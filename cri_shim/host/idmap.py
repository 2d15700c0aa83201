"""Idmapped mounts (Linux 5.12): a mount whose files appear to a user namespace's ids
as the host's files appear to the host's, and the uid/gid mappings of such a namespace.

runc 1.1 cannot idmap a mount itself, so the daemon does it: `open_tree` clones the
source, `mount_setattr(MOUNT_ATTR_IDMAP)` attaches the pod's user namespace to the clone,
and `move_mount` puts it on a staging point that runc bind-mounts from (a bind mount of
an idmapped mount keeps the idmapping).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.host.libc import check, libc
from cri_shim.host.mounts import detach

# x86-64 and aarch64 share these system call numbers (the "generic" table since 5.2).
_NR_OPEN_TREE = 428
_NR_MOVE_MOUNT = 429
_NR_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x100000

# The CRI field the mappings come from, named in refusals.
_FIELD = "linux.security_context.namespace_options.userns_options"


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class IdRange:
    container_id: int
    host_id: int
    size: int

    def oci(self) -> dict[str, int]:
        return {"containerID": self.container_id, "hostID": self.host_id, "size": self.size}


@dataclass(frozen=True)
class UserNamespaceMappings:
    """A pod's uid and gid mappings, validated."""

    uids: tuple[IdRange, ...]
    gids: tuple[IdRange, ...]

    def map_text(self, kind: str) -> str:
        """The contents to write to /proc/<pid>/uid_map ("uid") or gid_map ("gid")."""
        ranges = self.uids if kind == "uid" else self.gids
        return "".join(f"{r.container_id} {r.host_id} {r.size}\n" for r in ranges)

    def root_ids(self) -> tuple[int, int]:
        """The host uid and gid of the pod's root (pod_mappings made sure both exist)."""
        uid, gid = self.host_uid(0), self.host_gid(0)
        if uid is None or gid is None:
            raise InvalidArgument(f"{_FIELD}: container id 0 (the pod's root) must be mapped")
        return uid, gid

    def host_uid(self, container_uid: int) -> int | None:
        return to_host(self.uids, container_uid)

    def host_gid(self, container_gid: int) -> int | None:
        return to_host(self.gids, container_gid)

    def oci(self) -> dict[str, Any]:
        return {
            "uidMappings": [r.oci() for r in self.uids],
            "gidMappings": [r.oci() for r in self.gids],
        }


def to_host(ranges: Sequence[IdRange], container_id: int) -> int | None:
    for r in ranges:
        if r.container_id <= container_id < r.container_id + r.size:
            return r.host_id + container_id - r.container_id
    return None


def idmapped_mount(source: str | int, target: Path, userns_fd: int) -> None:
    """Mount a recursive clone of `source` (a path, or an fd opened with O_PATH) on
    `target`, idmapped through the user namespace `userns_fd`. Raises OSError; EINVAL
    means the source's filesystem cannot be idmapped."""
    if isinstance(source, int):
        tree = libc.syscall(
            _NR_OPEN_TREE,
            source,
            b"",
            _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE | _AT_EMPTY_PATH,
        )
    else:
        tree = libc.syscall(
            _NR_OPEN_TREE,
            _AT_FDCWD,
            os.fsencode(source),
            _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE,
        )
    fd = check(tree, f"open_tree {source}")
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        check(
            libc.syscall(
                _NR_MOUNT_SETATTR,
                fd,
                b"",
                _AT_EMPTY_PATH | _AT_RECURSIVE,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            ),
            f"idmap {source}",
        )
        check(
            libc.syscall(
                _NR_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH
            ),
            f"move_mount {source} to {target}",
        )
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_userns(path: Path) -> Iterator[int]:
    """An fd of the pinned user namespace at `path`, for mount_setattr."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise FailedPrecondition(
            f"the pod's user namespace {path} is gone: {exc.strerror}"
        ) from None
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def idmapped_layers(
    layers: Sequence[Path], userns_path: Path, staging: Path
) -> Iterator[list[Path]]:
    """Idmapped clones of `layers` attached under `staging` for as long as the block runs
    (overlayfs takes private clones of its layers when it mounts, so the staging points
    are detached afterwards and nothing is left mounted)."""
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    points: list[Path] = []
    try:
        with open_userns(userns_path) as userns_fd:
            for index, layer in enumerate(layers):
                point = staging / str(index)
                point.mkdir(mode=0o700, exist_ok=True)
                points.append(point)
                try:
                    idmapped_mount(str(layer), point, userns_fd)
                except OSError as exc:
                    raise FailedPrecondition(
                        f"cannot idmap image layer {layer} for the pod's user namespace: "
                        f"{exc.strerror} (its filesystem must support idmapped mounts)"
                    ) from exc
        yield points
    finally:
        for point in reversed(points):
            with contextlib.suppress(OSError):
                detach(point)
            # rmdir, never rmtree: a point still mounted holds a layer's files.
            with contextlib.suppress(OSError):
                point.rmdir()
        with contextlib.suppress(OSError):
            staging.rmdir()
