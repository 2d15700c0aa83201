"""Plugins' container adjustments, checked and applied to the OCI spec before `runc create`.

The adjustments of every plugin that answered CreateContainer are applied in plugin order.
Two plugins adjusting the same thing (one environment variable, one mount destination,
one annotation, one resource limit) is a conflict that fails the creation, as the
reference runtime does: neither plugin would get what it asked for. A name prefixed with
"-" removes that item. What the runtime cannot apply (hooks, devices, rlimits, seccomp, and
the rest of LinuxContainerAdjustment) is refused by name rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from cri_shim import cpusets
from cri_shim.errors import InvalidArgument
from cri_shim.nri.api import api_pb2

_APPLIED_LINUX = {"resources", "oom_score_adj"}
_APPLIED_MEMORY = {"limit", "reservation", "swap"}
_APPLIED_CPU = {"shares", "quota", "period", "cpus", "mems"}
_APPLIED_RESOURCES = {"memory", "cpu", "pids"}


class AdjustmentRefused(InvalidArgument):
    """A plugin's adjustment cannot be applied; the creation fails with this."""


def apply_adjustments(
    spec: dict[str, Any], adjustments: list[tuple[str, api_pb2.ContainerAdjustment]]
) -> None:
    """Apply each (plugin id, adjustment) to `spec`, in order; refuse before changing
    anything if one is unsupported or two conflict."""
    owners: dict[str, str] = {}
    for plugin, adjustment in adjustments:
        _check_supported(plugin, adjustment)
        for key in _claims(adjustment):
            if key in owners and owners[key] != plugin:
                raise AdjustmentRefused(f"NRI plugins {owners[key]} and {plugin} both adjust {key}")
            owners[key] = plugin
    for _, adjustment in adjustments:
        _apply(spec, adjustment)


def _check_supported(plugin: str, adjustment: api_pb2.ContainerAdjustment) -> None:
    unsupported = [
        f.name
        for f, _ in adjustment.ListFields()
        if f.name not in {"annotations", "mounts", "env", "args", "linux"}
    ]
    linux = adjustment.linux
    unsupported += [
        f"linux.{f.name}" for f, _ in linux.ListFields() if f.name not in _APPLIED_LINUX
    ]
    unsupported += unsupported_resources(linux.resources)
    if unsupported:
        raise AdjustmentRefused(
            f"NRI plugin {plugin}: cri-shim cannot apply the adjustment of {', '.join(unsupported)}"
        )
    check_cpusets(linux.resources, f"NRI plugin {plugin}: ")
    for mount in adjustment.mounts:
        if not mount.destination.startswith("-") and not mount.destination.startswith("/"):
            raise AdjustmentRefused(
                f"NRI plugin {plugin}: mount destination {mount.destination!r} is not absolute"
            )


def _claims(adjustment: api_pb2.ContainerAdjustment) -> list[str]:
    claims = [f"annotation {k.removeprefix('-')!r}" for k in adjustment.annotations]
    claims += [f"environment variable {kv.key.removeprefix('-')!r}" for kv in adjustment.env]
    claims += [f"mount {m.destination.removeprefix('-')!r}" for m in adjustment.mounts]
    if adjustment.args:
        claims.append("the command")
    linux = adjustment.linux
    if linux.HasField("oom_score_adj"):
        claims.append("oom_score_adj")
    resources = linux.resources
    claims += [f"memory {f.name}" for f, _ in resources.memory.ListFields()]
    claims += [f"cpu {f.name}" for f, _ in resources.cpu.ListFields()]
    if resources.HasField("pids"):
        claims.append("pids limit")
    return claims


def _apply(spec: dict[str, Any], adjustment: api_pb2.ContainerAdjustment) -> None:
    annotations = spec.setdefault("annotations", {})
    for key, value in adjustment.annotations.items():
        if key.startswith("-"):
            annotations.pop(key[1:], None)
        else:
            annotations[key] = value
    process = spec.setdefault("process", {})
    env: list[str] = process.setdefault("env", [])
    for kv in adjustment.env:
        name = kv.key.removeprefix("-")
        env[:] = [e for e in env if e.split("=", 1)[0] != name]
        if not kv.key.startswith("-"):
            env.append(f"{kv.key}={kv.value}")
    if adjustment.args:
        process["args"] = list(adjustment.args)
    mounts: list[dict[str, Any]] = spec.setdefault("mounts", [])
    for mount in adjustment.mounts:
        destination = mount.destination.removeprefix("-")
        mounts[:] = [m for m in mounts if m.get("destination") != destination]
        if not mount.destination.startswith("-"):
            mounts.append(
                {
                    "destination": mount.destination,
                    "type": mount.type or "bind",
                    "source": mount.source,
                    "options": list(mount.options),
                }
            )
    linux = adjustment.linux
    if linux.HasField("oom_score_adj"):
        process["oomScoreAdj"] = linux.oom_score_adj.value
    resources = spec.setdefault("linux", {}).setdefault("resources", {})
    for key, values in oci_resources(linux.resources).items():
        if isinstance(values, dict) and key != "pids":
            resources.setdefault(key, {}).update(values)
        else:
            resources[key] = values


def check_cpusets(resources: api_pb2.LinuxResources, who: str = "") -> None:
    """A plugin's CPUs and memory nodes are held to what the host has online, as a
    request's are (runtime/cpusets.py)."""
    for name in ("cpus", "mems"):
        value = getattr(resources.cpu, name)
        try:
            cpusets.check(value, f"{who}linux.resources.cpu.{name}", nodes=name == "mems")
        except InvalidArgument as err:
            raise AdjustmentRefused(str(err)) from None


def oci_resources(adjusted: api_pb2.LinuxResources) -> dict[str, Any]:
    """The OCI LinuxResources fields an NRI LinuxResources sets (those we apply); CPUs
    and nodes the host does not have online are refused."""
    check_cpusets(adjusted)
    resources: dict[str, Any] = {}
    if adjusted.HasField("memory"):
        resources["memory"] = {
            field.name: getattr(adjusted.memory, field.name).value
            for field, _ in adjusted.memory.ListFields()
        }
    if adjusted.HasField("cpu"):
        resources["cpu"] = {
            field.name: value if field.name in {"cpus", "mems"} else value.value
            for field, value in adjusted.cpu.ListFields()
        }
    if adjusted.HasField("pids"):
        resources["pids"] = {"limit": adjusted.pids.limit}
    return resources


def unsupported_resources(resources: api_pb2.LinuxResources) -> list[str]:
    """The fields of an NRI LinuxResources that cri-shim cannot apply."""
    unsupported = [
        f"linux.resources.{f.name}"
        for f, _ in resources.ListFields()
        if f.name not in _APPLIED_RESOURCES
    ]
    unsupported += [
        f"linux.resources.memory.{f.name}"
        for f, _ in resources.memory.ListFields()
        if f.name not in _APPLIED_MEMORY
    ]
    unsupported += [
        f"linux.resources.cpu.{f.name}"
        for f, _ in resources.cpu.ListFields()
        if f.name not in _APPLIED_CPU
    ]
    return unsupported


# A CRI update's fields as NRI LinuxResources: (CRI field, NRI section, NRI field).
_CRI_UPDATE_FIELDS = (
    ("memory_limit_in_bytes", "memory", "limit"),
    ("memory_swap_limit_in_bytes", "memory", "swap"),
    ("cpu_shares", "cpu", "shares"),
    ("cpu_quota", "cpu", "quota"),
    ("cpu_period", "cpu", "period"),
    ("cpuset_cpus", "cpu", "cpus"),
    ("cpuset_mems", "cpu", "mems"),
)


def nri_resources_of(resources: Any) -> api_pb2.LinuxResources:
    """A CRI LinuxContainerResources update as plugins see it (the fields that are set)."""
    out = api_pb2.LinuxResources()
    for cri, section, name in _CRI_UPDATE_FIELDS:
        value = getattr(resources, cri)
        if not value:
            continue
        target = getattr(out, section)
        if name in {"cpus", "mems"}:
            setattr(target, name, value)
        else:
            getattr(target, name).value = value
    return out


def adjust_update(resources: Any, updates: list[tuple[str, api_pb2.LinuxResources]]) -> None:
    """Apply plugins' changes to a CRI update (a LinuxContainerResources, in place), in
    plugin order; two plugins changing one field, or a field a CRI update cannot carry,
    fail the update by the plugins' names."""
    owner: dict[str, str] = {}
    for plugin, changed in updates:
        # A CRI update has no pids limit nor memory reservation to carry these in.
        unsupported = unsupported_resources(changed)
        if changed.HasField("pids"):
            unsupported.append("linux.resources.pids")
        if changed.memory.HasField("reservation"):
            unsupported.append("linux.resources.memory.reservation")
        if unsupported:
            raise AdjustmentRefused(
                f"NRI plugin {plugin}: cannot apply to an update: {', '.join(unsupported)}"
            )
        check_cpusets(changed, f"NRI plugin {plugin}: ")
        for cri, section, name in _CRI_UPDATE_FIELDS:
            part = getattr(changed, section)
            if name in {"cpus", "mems"}:
                if not getattr(part, name):
                    continue
                value = getattr(part, name)
            elif part.HasField(name):
                value = getattr(part, name).value
            else:
                continue
            if cri in owner:
                raise AdjustmentRefused(
                    f"NRI plugins {owner[cri]} and {plugin} both change {section}.{name}"
                )
            owner[cri] = plugin
            setattr(resources, cri, value)
