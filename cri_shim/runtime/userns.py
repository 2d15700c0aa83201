"""Pod user namespaces (`userns_options` mode POD): the request's mappings, checked.

A pod with `hostUsers: false` gets one user namespace, pinned as a file like its other
namespaces, with the uid and gid mappings kubelet chose (kubelet hands each pod a
distinct range of host ids, 65536 wide, container id 0 at its start). The pod's network,
UTS and IPC namespaces are created inside it, so that the pod's root may use its own
network (bind low ports, set net.* sysctls) and mount mqueue, as in containerd 2 and
CRI-O. Every container of the pod joins the pinned user namespace by path.

The container's files are shown to it through idmapped mounts (Linux 5.12; overlayfs on
idmapped layers since 5.19; tmpfs since 6.3): a file that belongs to host uid 0 appears
owned by the pod's root, and a file the pod's root writes lands as the mapped host id
(`cri_shim.host.idmap` makes them). Image layers are idmapped the same way and
stacked by overlayfs, whose upper directory belongs to the pod's root on the host; the
staging clones of the layers are detached as soon as the overlay holds them.
"""

from __future__ import annotations

import itertools
import stat
from collections.abc import Sequence
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, InvalidArgument
from cri_shim.host.idmap import IdRange, UserNamespaceMappings, to_host

# The kernel takes at most this many lines in uid_map/gid_map (since Linux 4.15).
MAX_MAPPINGS = 340
_ID_LIMIT = 1 << 32  # ids are 32-bit; (uid_t)-1 is never valid
# Kernel versions: idmapped mounts of tmpfs (the pod's /dev/shm) arrived in 6.3, the
# last of what a pod's mounts need (ext4/xfs/btrfs 5.12, overlayfs layers 5.19).
IDMAP_KERNEL = (6, 3)

_FIELD = "linux.security_context.namespace_options.userns_options"


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
    if to_host(ranges, 0) is None:
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
