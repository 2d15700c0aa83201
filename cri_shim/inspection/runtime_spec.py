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


def process_user_of(container: ContainerRecord) -> dict[str, Any] | None:
    """The OCI spec's process.user: recorded in the row when the runtime made the
    container; a container made before the daemon recorded it has it read from its
    bundle. None when there is no spec (yet), or it cannot be read."""
    try:
        if container.process_user:
            user = json.loads(container.process_user)
        else:
            spec = json.loads((container.bundle_dir / "config.json").read_text())
            user = spec["process"]["user"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return user if isinstance(user, dict) else None
