"""What every part of a handler's backend shares: the runtime's command line and kind,
the containers' files, conmon's systemd scopes, the host's cgroups; and the removal of a
container from the runtime, which a deletion and a dead monitor's ending both run."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.cgroup_driver import is_systemd_path
from cri_shim.runtime.cgroup_layout import CgroupLayout, cgroup_layout
from cri_shim.runtime.conmon_scope import ConmonScopes
from cri_shim.runtime.container_files import ContainerFiles, Meta
from cri_shim.runtime.host_limits import HostLimits, current_host_limits
from cri_shim.runtime.kinds.base import HandlerKind
from cri_shim.runtime.oci import OciRuntime


@dataclass
class HandlerRuntime:
    handler_name: str
    kind: HandlerKind
    oci: OciRuntime
    files: ContainerFiles
    cgroup_root: Path
    # None: this host's, read when first asked.
    host: HostLimits | None = None
    # The systemd cgroup driver's: conmon's scope, and the units a delete may leave.
    scopes: ConmonScopes | None = None

    def host_limits(self) -> HostLimits:
        return self.host or current_host_limits()

    @property
    def cgroup_layout(self) -> CgroupLayout:
        """The host's cgroup layout (v1 or v2), through which its cgroups are read."""
        return cgroup_layout(self.cgroup_root, v2=self.host_limits().cgroup_v2)

    async def delete_from_runtime(self, container_id: str, meta: Meta | None) -> None:
        """`<runtime> delete --force` (killing it if it still runs); a missing container
        is fine. What the runtime leaves is removed here too: what the kind knows of (runsc's
        lock files), and the container's empty cgroups (see remove_cgroups)."""
        await self.kind.delete(self.oci, container_id, Path(meta.bundle) if meta else None)
        if meta is not None:
            if self.scopes is not None:
                await self.scopes.remove(container_id, meta.cgroups_path)
            await asyncio.to_thread(remove_cgroups, meta.cgroups_path, self.cgroup_layout)


def remove_cgroups(cgroups_path: str, layout: CgroupLayout) -> None:
    """The empty cgroups of a deleted container, which its runtime's `delete` could not
    find: a runtime killed inside its `create` (a create past its budget, a daemon
    stopping while one was in flight: runc makes the cgroups, cpuset first on cgroup v1,
    before it writes the state that names them), and runsc on cgroup v1 for a container
    it never started or whose sandbox was gone. One still in use (not empty) stays. A
    systemd cgroup (`slice:prefix:name`) is systemd's to remove, with its scope (which a
    delete stops where it is left: runtime/conmon_scope.py)."""
    relative = cgroups_path.strip("/")
    if not relative or is_systemd_path(relative):
        return
    for group in layout.directories(relative):
        with contextlib.suppress(OSError):
            group.rmdir()


def executable(path: Path, what: str) -> Path:
    found = shutil.which(str(path))
    if found is None:
        raise FailedPrecondition(f"{what} {path} not found or not executable")
    return Path(found).resolve()
