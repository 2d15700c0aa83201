"""How a container is deleted: out of the runtime (killed if it still runs), its conmon
made sure to be gone, and every file the backend made for it removed; and the undoing of a
create that failed half-way, which is the same deletion after conmon is killed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from pathlib import Path

from cri_shim.runtime.conmon_watch import ConmonWatch
from cri_shim.runtime.container_files import check_id, read_conmon_ref
from cri_shim.runtime.exits import reap, wait_process_exit
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.kinds.base import ContainerLimits
from cri_shim.runtime.monitors import alive

log = logging.getLogger(__name__)

MONITOR_EXIT_GRACE = 2.0  # after runc delete, how long conmon gets to exit by itself
# Files conmon (or runc through it) leaves in the bundle.
_BUNDLE_ARTIFACTS = ("pidfile", "attach", "ctl", "winsz")


class ContainerDelete:
    """Delete one handler's containers."""

    def __init__(
        self, runtime: HandlerRuntime, watch: ConmonWatch, limits: ContainerLimits
    ) -> None:
        self._runtime = runtime
        self._files = runtime.files
        self._watch = watch
        self._limits = limits

    async def delete(self, container_id: str) -> None:
        """Remove the container from the runtime (killing it if it still runs), make sure
        its conmon is gone, and remove the files this backend made. Idempotent."""
        check_id(container_id)
        # Its conmon's exit from here on is this deletion's doing, not a death to handle.
        await self._watch.forget(container_id)
        self._limits.forget(container_id)
        cdir = self._files.containers / container_id
        meta = self._files.read_meta(container_id)
        conmon = self._files.conmon_ref(container_id)
        await self._runtime.delete_from_runtime(container_id, meta)
        if conmon is not None and alive(conmon):
            await wait_process_exit(conmon, MONITOR_EXIT_GRACE)
            if alive(conmon):
                log.warning(
                    "conmon %d for %s outlived its container; killing it", conmon.pid, container_id
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(conmon.pid, signal.SIGKILL)
                await wait_process_exit(conmon, MONITOR_EXIT_GRACE)
        if conmon is not None:
            reap(conmon)
        # (A link in sockets/ is there for containers started by an earlier version.)
        for leftover in (self._files.exits / container_id, self._files.sockets / container_id):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        if meta is not None:
            for name in _BUNDLE_ARTIFACTS:
                with contextlib.suppress(FileNotFoundError):
                    (Path(meta.bundle) / name).unlink()
        shutil.rmtree(cdir, ignore_errors=True)

    async def discard(self, container_id: str) -> None:
        """Undo a failed create. Errors are logged, not raised: the create's own error
        is the one the caller must see."""
        await self._watch.forget(container_id)
        conmon = self._files.conmon_ref(container_id)
        if conmon is None:
            conmon = read_conmon_ref(self._files.containers / container_id)
        if conmon is not None and alive(conmon):
            # conmon leads its own process group, which holds a runc create in flight.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(conmon.pid, signal.SIGKILL)
            await wait_process_exit(conmon, MONITOR_EXIT_GRACE)
        try:
            await asyncio.shield(self.delete(container_id))
        except Exception as err:  # reported; the create's own error is the one raised
            log.error("cleaning up failed create of %s: %s", container_id, err)
