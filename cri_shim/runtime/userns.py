"""Pod user namespaces (`userns_options` mode POD) and the idmapped mounts they need.

A pod with `hostUsers: false` gets one user namespace, pinned as a file like its other
namespaces, with the uid and gid mappings kubelet chose (kubelet hands each pod a
distinct range of host ids, 65536 wide, container id 0 at its start). The pod's network,
UTS and IPC namespaces are created inside it, so that the pod's root may use its own
network (bind low ports, set net.* sysctls) and mount mqueue, as in containerd 2 and
CRI-O. Every container of the pod joins the pinned user namespace by path.

The container's files are shown to it through idmapped mounts (Linux 5.12; overlayfs on
idmapped layers since 5.19; tmpfs since 6.3): a file that belongs to host uid 0 appears
owned by the pod's root, and a file the pod's root writes lands as the mapped host id.
runc 1.1 cannot idmap a mount itself, so the daemon does it: `open_tree` clones the
source, `mount_setattr(MOUNT_ATTR_IDMAP)` attaches the pod's user namespace to the clone,
and `move_mount` puts it on a staging point that runc bind-mounts from (a bind mount of
an idmapped mount keeps the idmapping). Image layers are idmapped the same way and
stacked by overlayfs, whose upper directory belongs to the pod's root on the host; the
staging clones of the layers are detached as soon as the overlay holds them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument

# The kernel takes at most this many lines in uid_map/gid_map (since Linux 4.15).
MAX_MAPPINGS = 340
_ID_LIMIT = 1 << 32  # ids are 32-bit; (uid_t)-1 is never valid
# Kernel versions: idmapped mounts of tmpfs (the pod's /dev/shm) arrived in 6.3, the
# last of what a pod's mounts need (ext4/xfs/btrfs 5.12, overlayfs layers 5.19).
IDMAP_KERNEL = (6, 3)

_FIELD = "linux.security_context.namespace_options.userns_options"

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
_MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


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
        return _to_host(self.uids, container_uid)

    def host_gid(self, container_gid: int) -> int | None:
        return _to_host(self.gids, container_gid)

    def oci(self) -> dict[str, Any]:
        return {
            "uidMappings": [r.oci() for r in self.uids],
            "gidMappings": [r.oci() for r in self.gids],
        }


def _to_host(ranges: Sequence[IdRange], container_id: int) -> int | None:
    for r in ranges:
        if r.container_id <= container_id < r.container_id + r.size:
            return r.host_id + container_id - r.container_id
    return None


def pod_mappings(config: api_pb2.PodSandboxConfig) -> UserNamespaceMappings | None:
    """The pod's user namespace mappings, or None when it uses the host's. Raises
    InvalidArgument naming the field for a request the kernel or kubelet would refuse."""
    options = config.linux.security_context.namespace_options
    # Without userns_options the pod uses the host's (mode's protobuf default is POD).
    if not options.HasField("userns_options"):
        return None
    userns = options.userns_options
    if userns.mode == api_pb2.NODE:
        if userns.uids or userns.gids:
            raise InvalidArgument(f"{_FIELD}: uids and gids are only for mode POD, not NODE")
        return None
    if userns.mode != api_pb2.POD:
        mode = api_pb2.NamespaceMode.Name(userns.mode)
        raise InvalidArgument(f"{_FIELD}.mode: {mode} is not a user namespace mode (NODE or POD)")
    mappings = UserNamespaceMappings(
        uids=_ranges(userns.uids, f"{_FIELD}.uids"),
        gids=_ranges(userns.gids, f"{_FIELD}.gids"),
    )
    _refuse_host_namespaces(config)
    return mappings


def _ranges(raw: Sequence[api_pb2.IDMapping], field: str) -> tuple[IdRange, ...]:
    if not raw:
        raise InvalidArgument(f"{field}: mode POD needs at least one mapping")
    if len(raw) > MAX_MAPPINGS:
        raise InvalidArgument(f"{field}: {len(raw)} mappings; the kernel takes {MAX_MAPPINGS}")
    ranges = tuple(IdRange(m.container_id, m.host_id, m.length) for m in raw)
    for index, r in enumerate(ranges):
        if r.size == 0:
            raise InvalidArgument(f"{field}[{index}].length: must be at least 1")
        if r.container_id + r.size > _ID_LIMIT - 1 or r.host_id + r.size > _ID_LIMIT - 1:
            raise InvalidArgument(f"{field}[{index}]: the range runs past the largest id")
        if r.host_id == 0:
            raise InvalidArgument(
                f"{field}[{index}].host_id: 0 would give the pod the host's root; kubelet "
                "maps pods to host ids of 65536 and up"
            )
    for side in ("container_id", "host_id"):
        spans = sorted(
            (getattr(r, side), getattr(r, side) + r.size, i) for i, r in enumerate(ranges)
        )
        for (_, end, _), (start, _, index) in itertools.pairwise(spans):
            if start < end:
                raise InvalidArgument(f"{field}[{index}]: overlaps another mapping's {side}s")
    if _to_host(ranges, 0) is None:
        raise InvalidArgument(f"{field}: container id 0 (the pod's root) must be mapped")
    return ranges


def _refuse_host_namespaces(config: api_pb2.PodSandboxConfig) -> None:
    # kubelet refuses hostUsers: false with these too: a namespace of the host's is owned
    # by the host's user namespace, where the pod's root is nobody.
    options = config.linux.security_context.namespace_options
    for name, mode in (("network", options.network), ("pid", options.pid), ("ipc", options.ipc)):
        if mode == api_pb2.NODE:
            raise InvalidArgument(
                f"{_FIELD}: a pod with its own user namespace cannot use the host's {name} "
                f"namespace (namespace_options.{name} is NODE)"
            )


def require_searchable(path: Path) -> None:
    """runc mounts a container's root filesystem from inside the pod's user namespace,
    where the daemon's root is nobody: every directory on the way to the state root must
    let others search it (o+x), as /var/lib does."""
    for directory in (path, *path.parents):
        try:
            mode = directory.stat().st_mode
        except OSError:
            continue  # made later, with the default mode
        if not mode & stat.S_IXOTH:
            raise FailedPrecondition(
                f"{directory} is not searchable by other users (mode {stat.filemode(mode)}); "
                "a pod with its own user namespace needs the state root reachable: "
                f"chmod o+x {directory}"
            )


# ---- idmapped mounts -----------------------------------------------------------------


def _syscall_check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def idmapped_mount(source: str | int, target: Path, userns_fd: int) -> None:
    """Mount a recursive clone of `source` (a path, or an fd opened with O_PATH) on
    `target`, idmapped through the user namespace `userns_fd`. Raises OSError; EINVAL
    means the source's filesystem cannot be idmapped."""
    if isinstance(source, int):
        tree = _libc.syscall(
            _NR_OPEN_TREE,
            source,
            b"",
            _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE | _AT_EMPTY_PATH,
        )
    else:
        tree = _libc.syscall(
            _NR_OPEN_TREE,
            _AT_FDCWD,
            os.fsencode(source),
            _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE,
        )
    fd = _syscall_check(tree, f"open_tree {source}")
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        _syscall_check(
            _libc.syscall(
                _NR_MOUNT_SETATTR,
                fd,
                b"",
                _AT_EMPTY_PATH | _AT_RECURSIVE,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            ),
            f"idmap {source}",
        )
        _syscall_check(
            _libc.syscall(
                _NR_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH
            ),
            f"move_mount {source} to {target}",
        )
    finally:
        os.close(fd)


def detach(target: Path) -> None:
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


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
