"""Image volumes (`Mount.image`, KEP 4639): an image's files mounted read-only into a
container, optionally only one of its sub paths.

The image must be in the store (kubelet pulls it first and sends the image reference that
PullImage returned). Its layers are stacked by a read-only overlay with no upper layer
under the container's bundle, and the container gets a read-only, nosuid, nodev, noexec
bind mount of it (or of the sub path). Each overlay's unmount is journaled before it is
mounted, so removal, failure and restart undo it like the root filesystem. The layers
are recorded with the container, so removing the image while the volume is mounted
keeps them (the same rule as for the root filesystem's layers).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path, PurePosixPath

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import Internal, InvalidArgument, NotFound
from cri_shim.host import mounts
from cri_shim.host.idmap import idmapped_layers
from cri_shim.images.store import ImageStore
from cri_shim.runtime.identity import resolve_in_root
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.journal import Journal

VOLUMES_DIR = "image-volumes"
# Undone by the container service's own action: unmount an overlay at `path`.
UNMOUNT_ACTION = "rootfs_unmount"
# The kernel copies mount options into one page.
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def is_image_mount(mount: api_pb2.Mount) -> bool:
    return mount.HasField("image") and bool(mount.image.image)


def resolve_image_volumes(
    images: ImageStore, request: api_pb2.ContainerConfig
) -> api_pb2.ContainerConfig:
    """Check each image volume of `request`; a copy with each one pinned to the stored
    image's ID. The container then reports that ID (the image's digest) in its status
    mounts, and a tag moved later cannot change what it mounts."""
    if not any(is_image_mount(m) for m in request.mounts):
        return request
    config = api_pb2.ContainerConfig()
    config.CopyFrom(request)
    for index, mount in enumerate(config.mounts):
        if not is_image_mount(mount):
            continue
        field = f"mounts[{index}]"
        if mount.host_path:
            raise InvalidArgument(f"{field}: host_path and image are mutually exclusive")
        if not mount.readonly:
            # kubelet always sends readonly: an image volume can never be written.
            raise InvalidArgument(f"{field}.readonly: an image volume is always read-only")
        _check_sub_path(field, mount.image_sub_path)
        record = images.get(mount.image.image)
        if record is None:
            raise NotFound(
                f"{field}.image: image {mount.image.image!r} is not present: pull it first"
            )
        requested = mount.image.user_specified_image or mount.image.image
        mount.image.CopyFrom(api_pb2.ImageSpec(image=record.id, user_specified_image=requested))
    return config


def _check_sub_path(field: str, sub_path: str) -> None:
    if not sub_path:
        return
    path = PurePosixPath(sub_path)
    if path.is_absolute() or ".." in path.parts:
        raise InvalidArgument(
            f"{field}.image_sub_path: {sub_path!r} must be a relative path inside the image"
        )


async def mount_image_volumes(
    journal: Journal,
    rows: ContainerRepository,
    images: ImageStore,
    container_id: str,
    bundle: Path,
    config: api_pb2.ContainerConfig,
    userns_path: Path | None = None,
) -> dict[int, Path]:
    """Mount each image volume of `config` (resolved by resolve_image_volumes) under
    `bundle`; the host path each one's bind mount takes, by index in `config.mounts`.
    With `userns_path` (a pod with its own user namespace), the layers are idmapped
    through it, as the container's root filesystem is."""
    sources: dict[int, Path] = {}
    wanted = [(i, m) for i, m in enumerate(config.mounts) if is_image_mount(m)]
    if not wanted:
        return sources
    records = []
    for _index, mount in wanted:
        record = images.get(mount.image.image)
        if record is None:
            raise NotFound(f"image {mount.image.image!r} was removed while the container was made")
        records.append(record)
    # Recorded with the container: removing the image must keep what the volume stands on.
    rows.add_layers(container_id, [chain for record in records for chain in record.layers])
    # overlayfs needs two lower layers when there is no upper one: an empty bottom layer.
    empty = bundle / VOLUMES_DIR / "empty"
    empty.mkdir(parents=True, exist_ok=True)
    for (index, mount), record in zip(wanted, records, strict=True):
        target = bundle / VOLUMES_DIR / str(index)
        target.mkdir(parents=True, exist_ok=True)
        lowers = [*images.lower_dirs(record), empty]
        journal.record(container_id, UNMOUNT_ACTION, path=str(target))
        if userns_path is None:
            await asyncio.to_thread(_mount_read_only_overlay, lowers, target)
        else:
            staging = bundle / VOLUMES_DIR / f"idmap-{index}"
            await asyncio.to_thread(_mount_idmapped, lowers, target, userns_path, staging)
        sources[index] = _sub_path_source(index, target, mount.image_sub_path)
    return sources


def _mount_read_only_overlay(lowers: list[Path], target: Path) -> None:
    options = "lowerdir=" + ":".join(str(p) for p in lowers)
    if any("," in str(p) or ":" in str(p) for p in lowers) or len(options) >= _PAGE_SIZE:
        raise InvalidArgument(
            f"image volume at {target}: its {len(lowers) - 1} layers cannot be named in one "
            "overlay mount (paths too long or containing ',' or ':')"
        )
    try:
        mounts.mount("overlay", target, "overlay", mounts.MS_RDONLY, options)
    except OSError as err:
        raise Internal(f"image volume: {err}; the kernel log (dmesg) says why") from err


def _mount_idmapped(lowers: list[Path], target: Path, userns_path: Path, staging: Path) -> None:
    with idmapped_layers(lowers, userns_path, staging) as points:
        _mount_read_only_overlay(points, target)


def _sub_path_source(index: int, root: Path, sub_path: str) -> Path:
    if not sub_path:
        return root
    # Symlinks are followed as if the image were `/`, so a link cannot lead out of it.
    source = resolve_in_root(root, "/" + sub_path)
    if not source.exists():
        raise InvalidArgument(
            f"mounts[{index}].image_sub_path: {sub_path!r} does not exist in the image"
        )
    return source
