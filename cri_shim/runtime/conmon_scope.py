"""Where conmon runs under the systemd cgroup driver, and the units a container leaves.

Each conmon is moved, once it has made its container, into a transient scope of its own,
`cri-shim-conmon-<id>.scope`, in the slice `conmon_cgroup` names (`system.slice` by
default, the pod's slice for `pod`), as CRI-O does: out of cri-shim.service's cgroup, so
that the service's unit owns the daemon alone, and visible to systemd as what it is. The
scope ends with conmon (systemd collects an empty scope). conmon is named to systemd by
a pidfd checked to be the conmon recorded (its pid and start time), never by a pid alone
that may have been reused since (host/systemd_manager.py).

A container's own scope (`cri-shim-<id>.scope`) is runc's: `runc delete` stops it. A
runtime killed inside its `create` may leave it behind, so a delete stops it too (one
already gone is fine).
"""

from __future__ import annotations

import logging
import os

from cri_shim.errors import CriError
from cri_shim.host.systemd_manager import ProcessGone, SystemdManager
from cri_shim.runtime.cgroup_driver import (
    DEFAULT_SYSTEMD_PARENT,
    SCOPE_PREFIX,
    is_systemd_path,
    scope_unit,
    slice_of,
)
from cri_shim.runtime.monitors import ProcessRef, alive

log = logging.getLogger(__name__)

# conmon_cgroup's value for "the pod's slice".
POD = "pod"


def conmon_unit(container_id: str) -> str:
    return f"{SCOPE_PREFIX}-conmon-{container_id}.scope"


def conmon_slice(conmon_cgroup: str, cgroups_path: str) -> str:
    """The slice a container's conmon goes in: the configured one, or its pod's."""
    if conmon_cgroup == POD:
        return slice_of(cgroups_path)
    return conmon_cgroup or DEFAULT_SYSTEMD_PARENT


class ConmonScopes:
    """conmon's placement, and the units a deleted container leaves, through systemd."""

    def __init__(self, systemd: SystemdManager, conmon_cgroup: str = "") -> None:
        self._systemd = systemd
        self._conmon_cgroup = conmon_cgroup

    async def place(self, container_id: str, cgroups_path: str, conmon: ProcessRef) -> None:
        unit = conmon_unit(container_id)
        gone = (
            f"conmon ({conmon.pid}) of container {container_id} exited before systemd could "
            f"place it in {unit}"
        )
        try:
            pidfd = os.pidfd_open(conmon.pid)
        except ProcessLookupError:
            raise ProcessGone(gone) from None
        try:
            if not alive(conmon):  # checked after opening, so the pidfd is conmon's
                raise ProcessGone(gone)
            await self._systemd.start_scope(
                unit,
                conmon_slice(self._conmon_cgroup, cgroups_path),
                conmon.pid,
                pidfd,
                f"cri-shim conmon of container {container_id}",
            )
        finally:
            os.close(pidfd)

    async def remove(self, container_id: str, cgroups_path: str) -> None:
        """Stop the container's scope where its runtime left it."""
        if not is_systemd_path(cgroups_path):
            return
        unit = scope_unit(cgroups_path)
        try:
            if await self._systemd.stop_unit(unit):
                log.info("stopped %s, left by container %s's runtime", unit, container_id)
        except CriError as err:  # refused, or systemd did not answer in time
            # The container itself is gone; an empty scope is systemd's to collect.
            log.warning("could not stop %s of container %s: %s", unit, container_id, err)

    async def close(self) -> None:
        await self._systemd.close()
