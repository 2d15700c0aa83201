"""CRI LinuxContainerResources → OCI `linux.resources`, for create and for UpdateContainerResources.

Zero means "not set" in CRI, and an absent key means "leave as is" to `runc update`, so
zero values are left out rather than written as limits of zero.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.host_limits import HostLimits

log = logging.getLogger(__name__)


def clamp_oom_score_adj(requested: int, host: HostLimits, container: str = "container") -> int:
    """No process may get a lower oom_score_adj than the daemon: lowering it needs
    CAP_SYS_RESOURCE, which this host's bounding set lacks, and runc then dies with
    "can't get final child's PID from pipe"."""
    if requested < -1000 or requested > 1000:
        raise InvalidArgument(f"resources.oom_score_adj: {requested} is outside -1000..1000")
    if requested < host.oom_score_adj:
        log.info(
            "%s: oom_score_adj %d raised to the daemon's own %d",
            container,
            requested,
            host.oom_score_adj,
        )
        return host.oom_score_adj
    return requested


@functools.cache
def _log_hugetlb_unenforced() -> None:
    # kubelet sends a (zero) limit for every page size the node has; runc fails the
    # container if it has no hugetlb controller to write it to. containerd leaves them out
    # in that case too (tolerate_missing_hugetlb_controller).
    log.warning("hugepage limits are not enforced: the cgroup hierarchy has no hugetlb controller")


def linux_resources(
    resources: api_pb2.LinuxContainerResources | None, host: HostLimits
) -> dict[str, Any]:
    """The OCI LinuxResources object (without `devices`, which the spec builder owns)."""
    out: dict[str, Any] = {}
    if resources is None:
        return out
    for name in (
        "cpu_period",
        "cpu_quota",
        "cpu_shares",
        "memory_limit_in_bytes",
        "memory_swap_limit_in_bytes",
    ):
        value = getattr(resources, name)
        # cpu_quota -1 is the kernel's "unlimited"; any other negative is a mistake.
        if value < 0 and not (name == "cpu_quota" and value == -1):
            raise InvalidArgument(f"resources.{name}: {value} must not be negative")

    cpu: dict[str, Any] = {}
    if resources.cpu_shares:
        cpu["shares"] = resources.cpu_shares
    if resources.cpu_quota:
        cpu["quota"] = resources.cpu_quota
    if resources.cpu_period:
        cpu["period"] = resources.cpu_period
    if resources.cpuset_cpus:
        cpu["cpus"] = resources.cpuset_cpus
    if resources.cpuset_mems:
        cpu["mems"] = resources.cpuset_mems
    if cpu:
        out["cpu"] = cpu

    memory: dict[str, Any] = {}
    if resources.memory_limit_in_bytes:
        memory["limit"] = resources.memory_limit_in_bytes
    if host.swap_accounting:
        if resources.memory_swap_limit_in_bytes:
            memory["swap"] = resources.memory_swap_limit_in_bytes
        elif resources.memory_limit_in_bytes:
            # Memory+swap equal to memory: the container gets no swap, as kubelet expects
            # on a node without the swap feature.
            memory["swap"] = resources.memory_limit_in_bytes
    elif resources.memory_swap_limit_in_bytes:
        log.info("memory_swap_limit_in_bytes ignored: this host has no swap accounting")
    if memory:
        out["memory"] = memory

    if resources.hugepage_limits and not host.hugetlb:
        _log_hugetlb_unenforced()
    elif resources.hugepage_limits:
        out["hugepageLimits"] = [
            {"pageSize": limit.page_size, "limit": limit.limit}
            for limit in resources.hugepage_limits
        ]
    if resources.unified:
        if not host.cgroup_v2:
            raise InvalidArgument(
                "resources.unified: cgroup v2 settings given, but this host uses cgroup v1"
            )
        out["unified"] = dict(resources.unified)
    return out
