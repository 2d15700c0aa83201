"""Rows that tests of the state and of the lifecycle start from."""

from __future__ import annotations

from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.state.containers import ContainerRepository


def add_container(rows: ContainerRepository, container_id: str, sandbox_id: str) -> None:
    """A container's row as its creation's first step writes it: in flight, created."""
    rows.insert(
        container_id,
        f"k8s_app_{container_id}",
        sandbox_id,
        stage="container storage",
        image_id="sha256:aa",
        image_ref="busybox",
        repo_digest="",
        config=api_pb2.ContainerConfig(metadata=api_pb2.ContainerMetadata(name="app")),
        log_path="",
        bundle_dir=Path("/b"),
        rootfs=Path("/b/rootfs"),
        layers=["l1"],
    )
