"""How a container stops: its stop signal, a grace period, then SIGKILL to every process
of it, until conmon has recorded the exit."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from pathlib import Path

from cri_shim.errors import DeadlineExceeded, FailedPrecondition, Internal, NotFound
from cri_shim.runtime.exits import ContainerExits
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.stop_signal import discarded_by_init, send_again_once_caught

log = logging.getLogger(__name__)

KILL_GRACE = 10.0  # after SIGKILL, how long until the exit must be recorded

# A runtime's answer to a kill whose process exited after the runtime found it running:
# runc's "unable to signal init: os: process already finished", crun's and runsc's
# ESRCH ("No such process").
_EXITED_MEANWHILE = re.compile(r"process already finished|no such process|\besrch\b", re.I)


class ContainerStop:
    """Stop one handler's containers."""

    def __init__(self, runtime: HandlerRuntime, exits: ContainerExits) -> None:
        self._runtime = runtime
        self._exits = exits

    async def stop(
        self,
        container_id: str,
        timeout: float,
        stop_signal: int,
    ) -> None:
        """Send `stop_signal`, wait up to `timeout` seconds, then SIGKILL every process
        of the container. Stopping a stopped or unknown container does nothing."""
        if self._exits.exit_status(container_id) is not None:
            return
        if timeout > 0:
            if not await self._signal(container_id, stop_signal, all_processes=False):
                return
            if await self._wait_stopping(container_id, timeout, stop_signal):
                return
            log.info(
                "%s did not stop within %gs after signal %d; killing it",
                container_id,
                timeout,
                stop_signal,
            )
        if not await self._signal(container_id, signal.SIGKILL, all_processes=True):
            return
        if not await self._exits.wait_monitor(container_id, KILL_GRACE):
            raise DeadlineExceeded(
                f"container {container_id} did not exit within {KILL_GRACE:g}s of SIGKILL"
            )

    async def _wait_stopping(self, container_id: str, timeout: float, sig: int) -> bool:
        """wait_monitor() after the stop signal; a signal the container's init discarded
        (it had no handler yet) is sent again once it has one (runtime/stop_signal.py)."""
        pid = self._init_pid(container_id)
        if pid is None or not await asyncio.to_thread(discarded_by_init, pid, sig):
            return await self._exits.wait_monitor(container_id, timeout)
        log.info(
            "%s: its init had no handler for signal %d yet; sending it again once it has",
            container_id,
            sig,
        )
        again = asyncio.create_task(
            send_again_once_caught(
                pid, sig, lambda: self._signal(container_id, sig, all_processes=False)
            )
        )
        try:
            return await self._exits.wait_monitor(container_id, timeout)
        finally:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)

    def _init_pid(self, container_id: str) -> int | None:
        """The container's first process, from the pidfile the runtime wrote."""
        meta = self._runtime.files.read_meta(container_id)
        if meta is None:
            return None
        try:
            return int((Path(meta.bundle) / "pidfile").read_text().strip())
        except (OSError, ValueError):
            return None

    async def _signal(self, container_id: str, sig: int, *, all_processes: bool) -> bool:
        """False when there is nothing left to signal."""
        try:
            await self._runtime.oci.kill(container_id, sig, all=all_processes)
        except NotFound:
            return False
        except Internal as err:
            if _EXITED_MEANWHILE.search(str(err)) and await self._stopped(container_id):
                # It exited between the runtime's look and its signal (a stop beside a
                # removal, or its own end): stopped, which is what was asked.
                log.info("%s exited before it was signalled: %s", container_id, err)
                return False
            # Some runtimes cannot signal a container before it is started (runsc, of
            # one joining a sandbox): the kind ends it otherwise, or the error stands.
            meta = self._runtime.files.read_meta(container_id)
            if meta is None or not self._runtime.kind.end_unstarted(Path(meta.bundle), err):
                raise
        except FailedPrecondition:
            # "container not running": it exited after our check; conmon records it.
            await self._exits.wait_monitor(container_id, KILL_GRACE)
            return False
        return True

    async def _stopped(self, container_id: str) -> bool:
        """Whether a container the runtime could not signal is in fact stopped, its exit
        recorded (or its conmon gone too, which ends it)."""
        if await self._exits.state(container_id) not in ("stopped", "unknown"):
            return False
        return await self._exits.wait_monitor(container_id, KILL_GRACE)
