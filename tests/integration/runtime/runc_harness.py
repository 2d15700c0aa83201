"""Helpers for the runc + conmon tests: build, run and read back busybox containers."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.spec import ImageConfigView, SandboxContext, build_spec
from tests.crilog import Stream, join_partials, read_records


@dataclass
class Runtime:
    """A backend and helpers to build, run and read back containers."""

    backend: RuntimeBackend
    base: Path
    template: Path

    def spec(
        self,
        cid: str,
        cfg: api_pb2.ContainerConfig,
        sandbox: SandboxContext | None = None,
        image: ImageConfigView | None = None,
    ) -> dict[str, Any]:
        rootfs = self.base / "rootfs" / cid
        if not rootfs.exists():
            shutil.copytree(self.template, rootfs, symlinks=True)
        return build_spec(
            cfg,
            sandbox or SandboxContext(pod_id="pod"),
            image or ImageConfigView(),
            rootfs,
            container_id=cid,
        )

    def log_path(self, cid: str) -> Path:
        return self.base / "logs" / f"{cid}.log"

    async def create(self, cfg: api_pb2.ContainerConfig, **kwargs: Any) -> str:
        cid = kwargs.pop("cid", None) or f"it-{uuid.uuid4().hex[:12]}"
        spec = self.spec(cid, cfg, kwargs.get("sandbox"), kwargs.get("image"))
        await self.backend.create(
            cid, self.base / "bundles" / cid, spec, self.log_path(cid), cfg.tty, cfg.stdin
        )
        return cid

    async def run(self, cfg: api_pb2.ContainerConfig, **kwargs: Any) -> tuple[str, int]:
        """Create, start and wait: (id, exit code)."""
        cid = await self.create(cfg, **kwargs)
        await self.backend.start(cid)
        code, _ = await self.backend.wait_exit(cid, kwargs.get("timeout", 20))
        return cid, code

    def output(self, cid: str, stream: Stream = Stream.STDOUT) -> str:
        return "\n".join(
            m.content.decode()
            for m in join_partials(read_records(self.log_path(cid)))
            if m.stream == stream
        )


def shell(script: str, **fields: Any) -> api_pb2.ContainerConfig:
    cfg = api_pb2.ContainerConfig(command=["/bin/sh", "-c", script], **fields)
    cfg.metadata.name = "it"
    cfg.linux.security_context.namespace_options.pid = api_pb2.CONTAINER
    return cfg
