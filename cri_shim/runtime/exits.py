"""A container's end as conmon records it: the exit file, waiting for it, the state the
runtime reports, and whether the OOM killer was the cause.

conmon writes the exit code to `exits/<id>` when the container's process ends, and then
exits itself; a conmon gone without that file died first (runtime/conmon_watch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping

from cri_shim.errors import DeadlineExceeded, Internal, NotFound
from cri_shim.runtime.cgroup_driver import cgroup_dir
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.monitors import ProcessRef, alive, process_stat
from cri_shim.runtime.oom_watch import OOM_MARKER, OomWatch

# runc's statuses as state() reports them.
_STATES: Mapping[str, str] = {
    "creating": "created",
    "created": "created",
    "running": "running",
    "pausing": "running",
    "paused": "running",
    "stopped": "stopped",
}


class ContainerExits:
    """The recorded exits of one handler's containers, and their states."""

    def __init__(self, runtime: HandlerRuntime, oom_watch: OomWatch | None) -> None:
        self._runtime = runtime
        self._files = runtime.files
        # None: OOM kills are read from the cgroup when an exit is recorded, if it is there.
        self._oom_watch = oom_watch

    def recorded_exits(self) -> set[str]:
        """The containers conmon has written an exit file for (maybe not all of it yet:
        exit_status() reads it)."""
        try:
            return set(os.listdir(self._files.exits))
        except FileNotFoundError:
            return set()

    def exit_status(self, container_id: str) -> tuple[int, int] | None:
        """(exit code, finished_at in ns since the epoch) once conmon recorded the exit.
        The finish time is the exit file's mtime: conmon writes it when the process ends,
        and it survives a daemon restart."""
        path = self._files.exits / container_id
        try:
            text = path.read_text().strip()
            finished = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        try:
            code = int(text)
        except ValueError:
            return None  # being written
        conmon = self._files.conmon_ref(container_id)
        if conmon is not None:
            reap(conmon)
        return code, finished

    async def wait_exit(
        self,
        container_id: str,
        timeout: float | None,
    ) -> tuple[int, int]:
        """Wait until the container has exited; return exit_status(). Raises
        DeadlineExceeded after `timeout` seconds (None waits for ever), and Internal when
        conmon is gone without recording an exit (killed, or the host rebooted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.exit_status(container_id)
            if status is not None:
                return status
            conmon = self._files.conmon_ref(container_id)
            if conmon is None or not alive(conmon):
                status = self.exit_status(container_id)  # written just before it exited
                if status is not None:
                    return status
                raise Internal(
                    f"the monitor of container {container_id} is gone without recording "
                    "an exit code"
                )
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"container {container_id} is still running")
            await wait_process_exit(conmon, remaining)

    async def wait_monitor(self, container_id: str, timeout: float) -> bool:
        """True once the exit is recorded or conmon is gone; False on timeout."""
        try:
            await self.wait_exit(container_id, timeout)
        except DeadlineExceeded:
            return False
        except Internal:
            return True
        return True

    def monitor_gone(self, container_id: str) -> bool:
        """Whether the container's conmon has exited, noticed by its watch or not yet."""
        conmon = self._files.conmon_ref(container_id)
        return conmon is not None and not alive(conmon)

    async def state(self, container_id: str) -> str:
        """created | running | stopped | unknown."""
        try:
            current = await self._runtime.oci.state(container_id)
        except NotFound:
            return self.unlisted_state(container_id)
        return _STATES.get(current.status, "unknown")

    async def states(self) -> dict[str, str]:
        """state() of every container runc knows, by ID, from one `runc list`: one
        `runc state` each made a node's start wait for a process per container."""
        return {s.id: _STATES.get(s.status, "unknown") for s in await self._runtime.oci.list()}

    def unlisted_state(self, container_id: str) -> str:
        """state() of a container runc does not know."""
        return "stopped" if self.exit_status(container_id) is not None else "unknown"

    def oom_killed(self, container_id: str) -> bool:
        """Whether the kernel's OOM killer killed a process of this container. Ask before
        delete(): the evidence is the watch's marker, conmon's, and the container's cgroup
        (under the systemd driver, gone once its last process is)."""
        if self._oom_watch is not None:
            self._oom_watch.drain()  # a kill queued before the exit was written
        cdir = self._files.containers / container_id
        if (cdir / OOM_MARKER).exists() or (cdir / "persist" / "oom").exists():
            return True
        meta = self._files.read_meta(container_id)
        if meta is None or not meta.cgroups_path:
            return False
        return self._runtime.cgroup_layout.oom_kills(cgroup_dir(meta.cgroups_path)) > 0


def reap(ref: ProcessRef) -> None:
    """conmon double-forks away from us, but with the daemon as child subreaper the
    monitor is re-parented to the daemon, and an exited one stays a zombie until
    reaped. Only this exact process (pid and start time) is reaped, never a pid that
    asyncio is waiting for."""
    found = process_stat(ref.pid)
    if found is None or found[2] != ref.start_time or found[0] != "Z":
        return
    if found[1] != os.getpid():
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(ref.pid, os.WNOHANG)


async def wait_process_exit(ref: ProcessRef, timeout: float | None) -> None:
    """Wait for any process (not only a child) to exit, through a pidfd."""
    try:
        pidfd = os.pidfd_open(ref.pid)
    except ProcessLookupError:
        return
    try:
        if not alive(ref):  # checked after opening, so the pidfd is the right process
            return
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, on_exit)
        try:
            await asyncio.wait_for(exited, timeout)
        except TimeoutError:
            return
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)
