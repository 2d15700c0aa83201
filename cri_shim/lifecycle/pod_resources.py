"""UpdatePodSandboxResources: the pod-level resources kubelet reports after a resize.

kubelet owns the pod's cgroup (with the cgroupfs driver it creates `cgroup_parent` and
resizes it itself before this call); each container's own limits reach the runtime
through UpdateContainerResources. What this call adds is the pod's total and its
overhead, for the runtime to know. They are checked (a value the runtime could never
apply is refused), then recorded with the sandbox as `resources.json`, reported by
PodSandboxStatus verbose, and removed with the sandbox directory. With NRI, plugins are
asked first (UpdatePodSandbox, which they may refuse) and told once the resize is recorded
(PostUpdatePodSandbox), as containerd does.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.pods import require_ready
from cri_shim.lifecycle.resource_rules import check_pod_resources
from cri_shim.runtime.host_limits import current_host_limits
from cri_shim.runtime.resources import linux_resources
from cri_shim.state.records import SandboxRecord

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

RESOURCES_FILE = "resources.json"


def record_pod_resources(
    sandbox: SandboxRecord,
    overhead: api_pb2.LinuxContainerResources | None,
    resources: api_pb2.LinuxContainerResources | None,
) -> None:
    # protobuf's JSON conversion (some 3.7 MiB with what it loads) only for the pods that
    # are resized, not in every daemon.
    from google.protobuf import json_format

    require_ready(sandbox)
    recorded: dict[str, Any] = {}
    for key, value in (("overhead", overhead), ("resources", resources)):
        if value is None:
            continue
        # The same conversion UpdateContainerResources uses: it raises InvalidArgument,
        # naming the field, for values no cgroup could take.
        linux_resources(value, current_host_limits())
        recorded[key] = json_format.MessageToDict(value, preserving_proto_field_name=True)
    path = sandbox.sandbox_dir / RESOURCES_FILE
    temporary = path.with_name(f".{RESOURCES_FILE}.tmp")
    temporary.write_text(json.dumps(recorded, sort_keys=True))
    os.replace(temporary, path)


def recorded_pod_resources(sandbox_dir: Path) -> dict[str, Any] | None:
    try:
        value: dict[str, Any] = json.loads((sandbox_dir / RESOURCES_FILE).read_text())
    except (OSError, ValueError):
        return None
    return value


class PodResources:
    """UpdatePodSandboxResources, and what it recorded: `sandbox_of` finds the visible pod
    by ID or prefix."""

    def __init__(
        self, sandbox_of: Callable[[str], SandboxRecord], nri: NriHooks | None = None
    ) -> None:
        self._sandbox_of = sandbox_of
        self._nri = nri

    async def update(
        self,
        sandbox_ref: str,
        overhead: api_pb2.LinuxContainerResources | None,
        resources: api_pb2.LinuxContainerResources | None,
    ) -> None:
        await asyncio.to_thread(
            check_pod_resources, overhead, resources, "UpdatePodSandboxResourcesRequest"
        )
        sandbox = self._sandbox_of(sandbox_ref)
        nri = self._nri if self._nri is not None and self._nri.enabled else None
        if nri is None:
            await asyncio.to_thread(record_pod_resources, sandbox, overhead, resources)
            return
        from cri_shim.nri.adjust import nri_resources_of
        from cri_shim.nri.objects import pod_of_record

        require_ready(sandbox)  # refused before plugins hear of it
        pod = pod_of_record(sandbox)
        await nri.update_pod(
            pod,
            nri_resources_of(overhead) if overhead is not None else None,
            nri_resources_of(resources) if resources is not None else None,
        )
        await asyncio.to_thread(record_pod_resources, sandbox, overhead, resources)
        await nri.pod_updated(pod)

    async def recorded(self, sandbox: SandboxRecord) -> dict[str, Any] | None:
        """What the last resize recorded (PodSandboxStatus verbose); None before any. Read
        in a worker thread: the file is on the host's disk."""
        return await asyncio.to_thread(recorded_pod_resources, sandbox.sandbox_dir)
