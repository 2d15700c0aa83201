"""What this host lets the daemon hand to a container: capabilities, OOM score, rlimits.

A container can never get more than the process that starts it. Asking runc for more fails
late and obscurely ("unable to apply caps: operation not permitted", "can't get final
child's PID from pipe"), so the spec builder clamps requests to these limits up front.
"""

from __future__ import annotations

import functools
import resource
from dataclasses import dataclass
from pathlib import Path

from cri_shim.runtime.capabilities import capabilities_from_mask


@dataclass(frozen=True)
class HostLimits:
    capability_bounding_set: frozenset[str]  # "CAP_..." names
    oom_score_adj: int  # the daemon's own; children may not go below it
    nofile_hard: int  # the daemon's RLIMIT_NOFILE hard limit
    cgroup_v2: bool  # unified hierarchy at /sys/fs/cgroup (False on v1 and hybrid)
    swap_accounting: bool  # memory.memsw.* (v1) or memory.swap.max (v2) exists
    # runc can set hugepage limits: a v1 hierarchy with the hugetlb controller is mounted,
    # or the v2 root offers it. kubelet sends a limit for every page size regardless.
    hugetlb: bool = True

    @classmethod
    def probe(
        cls, proc_self: Path = Path("/proc/self"), cgroup_root: Path = Path("/sys/fs/cgroup")
    ) -> HostLimits:
        status = (proc_self / "status").read_text()
        bounding = next(
            (line.split()[1] for line in status.splitlines() if line.startswith("CapBnd:")), "0"
        )
        cgroup_v2 = (cgroup_root / "cgroup.controllers").exists()
        if cgroup_v2:
            # The root cgroup has no memory.swap.max; a child of a swap-enabled root has.
            swap = "memory" in (cgroup_root / "cgroup.controllers").read_text().split() and any(
                child.joinpath("memory.swap.max").exists()
                for child in cgroup_root.iterdir()
                if child.is_dir()
            )
            hugetlb = "hugetlb" in (cgroup_root / "cgroup.controllers").read_text().split()
        else:
            swap = (cgroup_root / "memory" / "memory.memsw.limit_in_bytes").exists()
            # Found by its files, whatever the mount is called or co-mounted with.
            hugetlb = any(cgroup_root.glob("*/hugetlb.*.limit_in_bytes"))
        _, nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(
            capability_bounding_set=capabilities_from_mask(int(bounding, 16)),
            oom_score_adj=int((proc_self / "oom_score_adj").read_text().strip()),
            nofile_hard=nofile_hard if nofile_hard != resource.RLIM_INFINITY else 1 << 62,
            cgroup_v2=cgroup_v2,
            swap_accounting=swap,
            hugetlb=hugetlb,
        )


@functools.cache
def current_host_limits() -> HostLimits:
    """The daemon's limits, read once: they do not change while it runs."""
    return HostLimits.probe()
