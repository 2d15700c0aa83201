"""UpdatePodSandboxResources: the pod-level resources kubelet reports after a resize.

kubelet owns the pod's cgroup (with the cgroupfs driver it creates `cgroup_parent` and
resizes it itself before this call); each container's own limits reach the runtime
through UpdateContainerResources. What this call adds is the pod's total and its
overhead, for the runtime to know. They are checked (a value the runtime could never
apply is refused), then recorded with the sandbox as `resources.json`, reported by
PodSandboxStatus verbose, and removed with the sandbox directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.host_limits import current_host_limits
from cri_shim.runtime.resources import linux_resources
from cri_shim.state.records import SandboxRecord

RESOURCES_FILE = "resources.json"


def record_pod_resources(
    sandbox: SandboxRecord,
    overhead: api_pb2.LinuxContainerResources | None,
    resources: api_pb2.LinuxContainerResources | None,
) -> None:
    if not sandbox.ready:
        raise FailedPrecondition(f"pod sandbox {sandbox.id} is not ready (it was stopped)")
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
