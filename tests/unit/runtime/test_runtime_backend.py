"""RuntimeBackend, the one object per handler that the lifecycle holds: what it does
itself (a container's new limits, given where its kind applies them); each concern it
hands on is tested beside its module (test_runtime_create.py, test_runtime_stop.py, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.runtime.conmon import RuntimeBackend
from tests.unit.runtime.conftest import create


async def test_update_resources_passes_oci_resources(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    resources = api_pb2.LinuxContainerResources(cpu_shares=256, memory_limit_in_bytes=32 << 20)
    await stub_backend.update_resources("c1", resources)
    recorded = json.loads((tmp_path / "runtime-root" / "c1" / "resources.json").read_text())
    assert recorded == {"cpu": {"shares": 256}, "memory": {"limit": 32 << 20}}
