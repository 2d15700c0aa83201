"""Resource limits of a gVisor pod, where gVisor lets them apply: its host cgroups.

A gVisor pod is one sandbox: every process of every container runs in gVisor's kernel
(the Sentry), a host process in the host cgroup of the pod's sandbox container
(`<cgroup_parent>/cri-shim-<sandbox id>`), with its gofers. runsc gives each joining
container a cgroup of its own on the host too, but only for tools that look for one
(cAdvisor): no process is in it, and runsc creates it without limits. runsc (before
2026) has no `update` command, and inside the Sentry every container is in one root
cgroup whose memory and CPU files are stubs it does not enforce (its cgroupfs exists only
with `--cgroupfs`), so no container has a limit of its own inside gVisor.

So an update (UpdateContainerResources, or a container joining the pod) applies:
- to the container's own host cgroup, its limits as given: what the host's tools and
  the stats read, as for a runc container (nothing runs there, nothing is enforced);
- to the sandbox's host cgroup, the pod's total: the sum of its containers' limits and
  the pod's overhead (as kubelet sizes a pod's cgroup), unlimited where one container
  is: there the host kernel enforces it, on the pod as a whole (a pod past its memory
  limit loses its sandbox to the host's OOM killer, and all its containers with it; CPU
  is throttled for the pod).

Each container's current limits are its bundle's spec (`linux.resources`), which an
update rewrites: the spec is the record ContainerStatus reports (verbose `runtimeSpec`)
and the total is summed from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cri_shim import cpusets
from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, Internal
from cri_shim.runtime.host_limits import current_host_limits
from cri_shim.runtime.resources import linux_resources

# The CFS period a total is expressed in when the containers' periods differ.
DEFAULT_CFS_PERIOD = 100_000
# The kernel's floor for cpu.shares.
MIN_SHARES = 2
UNLIMITED = -1


def merged_resources(current: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """An OCI LinuxResources after an update: the update's CPU and memory fields replace
    the current ones (an absent field stays as it was, as with `runc update`); any other
    key it gives replaces the current one."""
    out = dict(current)
    for key, value in update.items():
        if key in ("cpu", "memory") and isinstance(value, Mapping):
            out[key] = {**(current.get(key) or {}), **value}
        else:
            out[key] = value
    return out


# The sandbox container's annotation holding the pod's overhead (OCI LinuxResources).
POD_OVERHEAD = "io.cri-shim.pod-overhead"


def record_overhead(spec: dict[str, Any], overhead: api_pb2.LinuxContainerResources) -> None:
    """Note in a sandbox container's spec what the pod's sandbox may use on top of its
    containers (kubelet's pod overhead, from the RuntimeClass). An annotation, not the
    spec's resources: runsc would give those alone to the sandbox before any container
    joins it, too little for gVisor's own start."""
    resources = linux_resources(overhead, current_host_limits())
    if resources:
        spec.setdefault("annotations", {})[POD_OVERHEAD] = json.dumps(resources)


def recorded_overhead(spec: Mapping[str, Any]) -> dict[str, Any]:
    try:
        overhead = json.loads((spec.get("annotations") or {}).get(POD_OVERHEAD) or "{}")
    except ValueError:
        return {}
    return overhead if isinstance(overhead, dict) else {}


def pod_total(
    containers: Iterable[Mapping[str, Any]], overhead: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The OCI LinuxResources of a pod whose containers have the given ones: sums where
    every container sets a limit, UNLIMITED where one does not; CPU sets united. The
    pod's overhead is added to each finite sum (as kubelet sizes a pod's cgroup)."""
    total = _containers_total(list(containers))
    extra_cpu = (overhead or {}).get("cpu") or {}
    extra_memory = (overhead or {}).get("memory") or {}
    cpu, memory = total["cpu"], total["memory"]
    if "shares" in cpu:
        cpu["shares"] += int(extra_cpu.get("shares") or 0)
    if int(cpu.get("quota", UNLIMITED)) > 0 and int(extra_cpu.get("quota") or 0) > 0:
        period = int(extra_cpu.get("period") or DEFAULT_CFS_PERIOD)
        cpu["quota"] += -(-int(extra_cpu["quota"]) * DEFAULT_CFS_PERIOD // period)
    for key in ("limit", "swap"):
        if int(memory.get(key, UNLIMITED)) > 0:
            memory[key] += int(extra_memory.get(key) or 0)
    return total


def _containers_total(resources: list[Mapping[str, Any]]) -> dict[str, Any]:
    cpus = [r.get("cpu") or {} for r in resources]
    memories = [r.get("memory") or {} for r in resources]
    total: dict[str, Any] = {"cpu": {}, "memory": {}}
    if not resources:
        return total
    total["cpu"]["shares"] = max(MIN_SHARES, sum(int(c.get("shares") or 1024) for c in cpus))
    if all(int(c.get("quota") or 0) > 0 for c in cpus):
        total["cpu"]["period"] = DEFAULT_CFS_PERIOD
        total["cpu"]["quota"] = sum(
            -(-int(c["quota"]) * DEFAULT_CFS_PERIOD // int(c.get("period") or DEFAULT_CFS_PERIOD))
            for c in cpus
        )
    else:
        total["cpu"]["quota"] = UNLIMITED
    for key in ("cpus", "mems"):
        sets = [c.get(key) or "" for c in cpus]
        # One container free to use every CPU makes the pod free to.
        total["cpu"][key] = _united(sets) if all(sets) else ""
    for key in ("limit", "swap"):
        values = [int(m.get(key) or 0) for m in memories]
        total["memory"][key] = sum(values) if all(v > 0 for v in values) else UNLIMITED
    pids = [int((r.get("pids") or {}).get("limit") or 0) for r in resources]
    total["pids"] = {"limit": sum(pids) if all(v > 0 for v in pids) else UNLIMITED}
    return total


def _united(lists: list[str]) -> str:
    """Cpuset lists together, as intervals (never their numbers: a spec written before
    requests were checked against the host may name billions)."""
    try:
        return cpusets.format_list(cpusets.union(*map(cpusets.parse, lists)))
    except cpusets.BadList as err:
        raise FailedPrecondition(
            f"a container of the pod has a cpuset the kernel refuses: {err}"
        ) from None


# What a gVisor pod's update can carry: the rest has no sum (`unified`, a free-form map of
# cgroup v2 files), or no meaning under gVisor, whose kernel takes no host hugepages.
APPLIED = frozenset({"cpu", "memory", "pids"})
IGNORED = frozenset({"hugepageLimits"})


def unappliable(update: Mapping[str, Any]) -> list[str]:
    """The keys of an OCI LinuxResources update a gVisor pod cannot take."""
    return sorted(key for key in update if key not in APPLIED | IGNORED)


def cgroup_writes(resources: Mapping[str, Any], *, v2: bool) -> list[tuple[str, str, str]]:
    """(controller, file, value) to write, in order, for OCI LinuxResources. On cgroup v1
    the controller is the hierarchy's directory; on v2 it is "" (one hierarchy). An empty
    cpuset means the parent's, read when written."""
    cpu = resources.get("cpu") or {}
    memory = resources.get("memory") or {}
    pids = resources.get("pids") or {}
    writes: list[tuple[str, str, str]] = []
    if "limit" in pids:
        writes.append(("" if v2 else "pids", "pids.max", _v2_bytes(pids["limit"])))
    if v2:
        if "shares" in cpu:
            # The conversion runc and the kernel documentation use.
            shares = int(cpu["shares"])
            writes.append(("", "cpu.weight", str(1 + ((shares - 2) * 9999) // 262142)))
        if "quota" in cpu:
            quota = int(cpu["quota"])
            period = int(cpu.get("period") or DEFAULT_CFS_PERIOD)
            writes.append(("", "cpu.max", f"{'max' if quota <= 0 else quota} {period}"))
        for key in ("cpus", "mems"):
            if key in cpu:
                writes.append(("", f"cpuset.{key}", cpu[key]))
        if "limit" in memory:
            writes.append(("", "memory.max", _v2_bytes(memory["limit"])))
        if "swap" in memory:
            # v1's memory+swap becomes v2's swap alone.
            limit, swap = int(memory.get("limit") or 0), int(memory["swap"])
            swap_only = swap - limit if swap > 0 and limit > 0 else UNLIMITED
            writes.append(("", "memory.swap.max", _v2_bytes(swap_only)))
        return writes
    if "shares" in cpu:
        writes.append(("cpu", "cpu.shares", str(int(cpu["shares"]))))
    if "period" in cpu:
        writes.append(("cpu", "cpu.cfs_period_us", str(int(cpu["period"]))))
    if "quota" in cpu:
        writes.append(("cpu", "cpu.cfs_quota_us", str(int(cpu["quota"]))))
    for key in ("cpus", "mems"):
        if key in cpu:
            writes.append(("cpuset", f"cpuset.{key}", cpu[key]))
    # memory+swap may never be below memory: raise it first, lower it last.
    if "limit" in memory and "swap" in memory:
        writes.append(("memory", "memory.memsw.limit_in_bytes", str(UNLIMITED)))
    if "limit" in memory:
        writes.append(("memory", "memory.limit_in_bytes", str(int(memory["limit"]))))
    if "swap" in memory:
        writes.append(("memory", "memory.memsw.limit_in_bytes", str(int(memory["swap"]))))
    return writes


def _v2_bytes(value: Any) -> str:
    """A limit as cgroup v2 (and pids.max) spells it: "max" for none."""
    return "max" if int(value) <= 0 else str(int(value))


def write_cgroup(
    cgroups_path: str,
    resources: Mapping[str, Any],
    *,
    v2: bool,
    swap_accounting: bool,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> None:
    """Write OCI LinuxResources into one cgroup (relative to each hierarchy's root). A
    missing cgroup (its container gone) is skipped; a value the kernel refuses raises
    FailedPrecondition naming the file and the kernel's reason."""
    relative = cgroups_path.strip("/")
    if not relative or ":" in relative:
        return  # none, or systemd's (slice:prefix:name), which cri-shim does not drive
    for controller, name, value in cgroup_writes(resources, v2=v2):
        if "memsw" in name and not swap_accounting:
            continue
        group = cgroup_root / controller / relative if controller else cgroup_root / relative
        if not group.is_dir():
            continue
        if name.startswith("cpuset.") and not value:
            value = _parent_value(group, name)
        try:
            (group / name).write_text(value)
        except FileNotFoundError:
            continue  # the controller is not enabled for this cgroup (v2)
        except OSError as err:
            reason = os.strerror(err.errno) if err.errno else str(err)
            if err.errno == errno.EBUSY and "memory" in name:
                reason += " (the pod uses more memory than that now)"
            raise FailedPrecondition(f"cannot set {name} of {group} to {value}: {reason}") from None


def _parent_value(group: Path, name: str) -> str:
    for ancestor in group.parents:
        with contextlib.suppress(OSError):
            value = (ancestor / name).read_text().strip()
            if value:
                return value
    raise Internal(f"no ancestor of {group} has a {name}")


def read_spec(bundle: Path, mentioning: str = "") -> dict[str, Any] | None:
    """A bundle's spec; None where it cannot be read, or does not hold `mentioning`."""
    try:
        raw = (bundle / "config.json").read_bytes()
        if mentioning and mentioning.encode() not in raw:
            return None
        spec: dict[str, Any] = json.loads(raw)
    except (OSError, ValueError):
        return None
    return spec
