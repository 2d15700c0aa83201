"""What a container was made with, as the runtime was told: its bundle's OCI spec."""

from __future__ import annotations

import json
from typing import Any

from cri_shim.state.records import ContainerRecord


def runtime_spec_of(container: ContainerRecord) -> dict[str, Any] | None:
    """The bundle's config.json; None before the runtime has made the container."""
    path = container.bundle_dir / "config.json"
    if not path.exists():
        return None
    spec: dict[str, Any] = json.loads(path.read_text())
    return spec
