"""Pods and containers as NRI describes them to plugins, from the runtime's records."""

from __future__ import annotations

from typing import Any

from cri_shim.api.v1 import api_pb2 as cri
from cri_shim.nri.api import api_pb2 as nri
from cri_shim.state.records import ContainerRecord, SandboxRecord

_STATES = {
    "created": nri.CONTAINER_CREATED,
    "running": nri.CONTAINER_RUNNING,
    "exited": nri.CONTAINER_STOPPED,
}


def pod_of(
    sandbox_id: str, config: cri.PodSandboxConfig, runtime_handler: str, ips: list[str]
) -> nri.PodSandbox:
    meta = config.metadata
    return nri.PodSandbox(
        id=sandbox_id,
        name=meta.name,
        uid=meta.uid,
        namespace=meta.namespace,
        labels=dict(config.labels),
        annotations=dict(config.annotations),
        runtime_handler=runtime_handler,
        ips=ips,
        linux=nri.LinuxPodSandbox(cgroup_parent=config.linux.cgroup_parent),
    )


def container_of(
    container_id: str,
    sandbox_id: str,
    config: cri.ContainerConfig,
    *,
    state: str = "",
    spec: dict[str, Any] | None = None,
    pid: int = 0,
    created_at: int = 0,
    started_at: int = 0,
    finished_at: int = 0,
    exit_code: int = 0,
) -> nri.Container:
    """The container; with its OCI spec, what the plugin sees is what runc would get."""
    container = nri.Container(
        id=container_id,
        pod_sandbox_id=sandbox_id,
        name=config.metadata.name,
        state=_STATES.get(state, nri.CONTAINER_UNKNOWN),
        labels=dict(config.labels),
        annotations=dict(config.annotations),
        args=[*config.command, *config.args],
        env=[f"{kv.key}={kv.value.decode(errors='replace')}" for kv in config.envs],
        pid=pid,
        created_at=created_at,
        started_at=started_at,
        finished_at=finished_at,
        exit_code=exit_code,
    )
    if spec is not None:
        process = spec.get("process", {})
        container.args[:] = process.get("args", [])
        container.env[:] = process.get("env", [])
        container.annotations.update(spec.get("annotations", {}))
        for mount in spec.get("mounts", []):
            container.mounts.add(
                destination=mount.get("destination", ""),
                type=mount.get("type", ""),
                source=mount.get("source", ""),
                options=mount.get("options", []),
            )
        _resources_into(container.linux.resources, spec.get("linux", {}).get("resources", {}))
    return container


def _resources_into(out: nri.LinuxResources, resources: dict[str, Any]) -> None:
    memory = resources.get("memory", {})
    for key in ("limit", "reservation", "swap"):
        if key in memory:
            getattr(out.memory, key).value = memory[key]
    cpu = resources.get("cpu", {})
    for key in ("shares", "quota", "period"):
        if key in cpu:
            getattr(out.cpu, key).value = cpu[key]
    for key in ("cpus", "mems"):
        if key in cpu:
            setattr(out.cpu, key, cpu[key])
    if "pids" in resources:
        out.pids.limit = resources["pids"].get("limit", 0)


def pod_of_record(sandbox: SandboxRecord) -> nri.PodSandbox:
    return pod_of(sandbox.id, sandbox.config, sandbox.runtime_handler, sandbox.ips)


def container_of_record(container: ContainerRecord) -> nri.Container:
    return container_of(
        container.id,
        container.sandbox_id,
        container.config,
        state=container.state,
        pid=container.pid,
        created_at=container.created_at,
        started_at=container.started_at,
        finished_at=container.finished_at,
        exit_code=container.exit_code,
    )
