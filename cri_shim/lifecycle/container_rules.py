"""What CreateContainer checks of a container's configuration against the host before
its name is reserved: each bind mount's host path exists, and its resources are within
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
    opened (runtime/mount_sources.py). An image volume is checked by image_volumes.py."""
    if mount.HasField("image") and mount.image.image:
        return
    try:
        os.stat(mount.host_path)
    except FileNotFoundError:
        raise InvalidArgument(f"{field}.host_path: {mount.host_path} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"{field}.host_path: {mount.host_path}: {exc.strerror}") from None
