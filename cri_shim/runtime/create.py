"""How a container is created and started: its id claimed, conmon launched (which runs
`<runtime> create`), its limits given to where the kind applies them, then its watch;
everything undone when any of it fails. `<runtime> start` then runs its process."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.conmon_launch import ConmonLauncher
from cri_shim.runtime.conmon_watch import ConmonWatch
from cri_shim.runtime.container_files import check_id
from cri_shim.runtime.delete import ContainerDelete
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.kinds.base import ContainerLimits

log = logging.getLogger(__name__)


class ContainerCreate:
    """Create and start one handler's containers."""

    def __init__(
        self,
        runtime: HandlerRuntime,
        launcher: ConmonLauncher,
        watch: ConmonWatch,
        limits: ContainerLimits,
        removal: ContainerDelete,
    ) -> None:
        self._runtime = runtime
        self._launcher = launcher
        self._watch = watch
        self._limits = limits
        self._removal = removal

    async def create(
        self,
        container_id: str,
        bundle: Path,
        spec: Mapping[str, Any],
        log_path: Path,
        tty: bool,
        stdin: bool,
        stdin_once: bool = True,
    ) -> int:
        """Write config.json, start conmon (which runs `runc create`), and return the
        container's pid once conmon reports it. On any failure, including cancellation,
        everything started is taken down again (conmon, runc state, files) and the error
        carries the runtime's own message."""
        check_id(container_id)
        cdir = self._runtime.files.containers / container_id
        try:
            cdir.mkdir()  # the claim on this id: atomic, so two creates cannot both win
        except FileExistsError:
            # Never "clean up" an id in use: that would destroy a live container.
            raise FailedPrecondition(
                f"container {container_id} already exists in runtime handler "
                f"{self._runtime.handler_name}; delete it first"
            ) from None
        started = time.monotonic()
        try:
            (cdir / "persist").mkdir()
            pid = await self._launcher.launch(
                container_id, cdir, bundle, spec, log_path, tty, stdin, stdin_once
            )
            await self._limits.created(spec)
        except BaseException:
            await self._removal.discard(container_id)
            raise
        self._watch.watch(container_id)
        log.debug(
            "created %s (pid %d) in %.1f ms", container_id, pid, (time.monotonic() - started) * 1000
        )
        return pid

    async def start(self, container_id: str) -> None:
        meta = self._runtime.files.read_meta(container_id)
        env = self._runtime.kind.start_env(Path(meta.bundle)) if meta is not None else {}
        if env:
            await self._runtime.oci.start(
                container_id, program=self._launcher.conmon_runtime, env=env
            )
        else:
            await self._runtime.oci.start(container_id)
