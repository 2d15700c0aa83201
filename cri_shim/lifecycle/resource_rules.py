"""What a container's or a pod's resources may ask for: the kernel's ranges for CFS and
the OOM score, swap that covers memory, and CPUs and memory nodes online here.

The operations that apply resources check them before anything is made or changed
(CreateContainer, UpdateContainerResources, RunPodSandbox, UpdatePodSandboxResources):
the kernel refuses such a value only when a cgroup file is written, after the container
was made, and runc's "invalid argument" names no field. The shapes of the fields (no
negative period, a cgroup file's name) are checked at the edge (server/validation.py).
The online CPUs are read from sysfs: call these from a worker thread.
"""

from __future__ import annotations

from cri_shim import cpusets
from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument


def check_resources(resources: api_pb2.LinuxContainerResources, field: str) -> None:
    """A container's resources, `field` naming them in the error."""
    # The kernel's own ranges (CFS: period 1ms..1s, quota at least 1ms).
    if resources.cpu_period and not 1000 <= resources.cpu_period <= 1_000_000:
        raise InvalidArgument(f"{field}.cpu_period: {resources.cpu_period} is not in 1000..1000000")
    if resources.cpu_shares and not 2 <= resources.cpu_shares <= 262_144:
        raise InvalidArgument(f"{field}.cpu_shares: {resources.cpu_shares} is not in 2..262144")
    if resources.cpu_quota > 0 and resources.cpu_quota < 1000:
        raise InvalidArgument(f"{field}.cpu_quota: {resources.cpu_quota} is below 1000 (1ms)")
    swap, memory = resources.memory_swap_limit_in_bytes, resources.memory_limit_in_bytes
    if swap > 0 and memory > 0 and swap < memory:
        raise InvalidArgument(
            f"{field}.memory_swap_limit_in_bytes: {swap} is below memory_limit_in_bytes "
            f"{memory} (it limits memory and swap together)"
        )
    if not -1000 <= resources.oom_score_adj <= 1000:
        oom = resources.oom_score_adj
        raise InvalidArgument(f"{field}.oom_score_adj: {oom} is not in -1000..1000")
    check_cpusets(resources, field)


def check_cpusets(resources: api_pb2.LinuxContainerResources, field: str) -> None:
    """Checked against the CPUs and nodes online here, for every handler: the kernel
    refuses others only when a cgroup is written, after the container was made."""
    for name in ("cpuset_cpus", "cpuset_mems"):
        cpusets.check(getattr(resources, name), f"{field}.{name}", nodes=name == "cpuset_mems")


def check_pod_resources(
    overhead: api_pb2.LinuxContainerResources | None,
    resources: api_pb2.LinuxContainerResources | None,
    field: str,
) -> None:
    """A pod's overhead and total (RunPodSandbox's linux, UpdatePodSandboxResources)."""
    if overhead is not None:
        check_cpusets(overhead, f"{field}.overhead")
    if resources is not None:
        check_cpusets(resources, f"{field}.resources")
