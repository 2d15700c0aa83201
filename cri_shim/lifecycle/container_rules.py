"""What CreateContainer checks of a container's configuration against the host before
its name is reserved: each bind mount's host path exists (made a directory if it does
not), and its resources are within
the kernel's ranges and the CPUs online (resource_rules.py). Reads the host (a `stat`
per mount, sysfs): run it in a worker thread.
"""

from __future__ import annotations

import os

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.lifecycle.resource_rules import check_resources


def check_container(config: api_pb2.ContainerConfig) -> None:
    for index, mount in enumerate(config.mounts):
        check_mount_source(mount, f"ContainerConfig.mounts[{index}]")
    check_resources(config.linux.resources, "ContainerConfig.linux.resources")


def check_mount_source(mount: api_pb2.Mount, field: str) -> None:
    """A bind mount's host path exists. Symlinks are followed, as kubelet expects (a host
    path may itself be a link); the creation opens the path once more and mounts what it
    opened (runtime/mount_sources.py). An image volume is checked by image_volumes.py.

    A missing host path is made a directory (0755, root's), as containerd and CRI-O do:
    kubelet checks a `hostPath` volume's path only when the volume names a type, and one of
    unset type that does not exist yet is the runtime's to make. It is left in place when
    the container goes, since other containers may use it."""
    if mount.HasField("image") and mount.image.image:
        return
    try:
        os.stat(mount.host_path)
        return
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise InvalidArgument(f"{field}.host_path: {mount.host_path}: {exc.strerror}") from None
    if not os.path.isabs(mount.host_path):
        raise InvalidArgument(f"{field}.host_path: {mount.host_path!r} must be an absolute path")
    try:
        os.makedirs(mount.host_path, mode=0o755, exist_ok=True)
    except OSError as exc:
        # A dangling symlink, a file on the way, a read-only filesystem.
        raise InvalidArgument(
            f"{field}.host_path: {mount.host_path} does not exist and cannot be made a "
            f"directory: {exc.strerror}"
        ) from None
