"""Each conmon watched, and the OOM kills of its container, from the container's creation
or from a restart until its deletion; and the ending of a container whose conmon died.

One that dies without writing the exit file leaves its container unmonitored:
end_unmonitored() kills and deletes it in the runtime, as containerd does for a task whose
shim died, and writes the exit file in conmon's place (255, the code containerd and CRI-O
report for an exit nobody recorded), so that the exit is recorded as any other. The
`monitor-died` marker, written first, tells why, and lets a restart finish what a crash
interrupted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from cri_shim.faults import fault_point
from cri_shim.runtime.cgroup_driver import cgroup_dir
from cri_shim.runtime.container_files import write_atomic
from cri_shim.runtime.exits import ContainerExits
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.monitors import MonitorWatch, alive
from cri_shim.runtime.oom_watch import OOM_MARKER, OomWatch

log = logging.getLogger(__name__)

# The exit code of a container whose monitor died: nobody saw it exit.
MONITOR_DIED_EXIT_CODE = 255
_MONITOR_DIED = "monitor-died"


class ConmonWatch:
    """The watches on one handler's conmons and cgroups, and what a dead conmon means."""

    def __init__(
        self,
        runtime: HandlerRuntime,
        exits: ContainerExits,
        monitors: MonitorWatch | None,
        oom_watch: OomWatch | None,
    ) -> None:
        self._runtime = runtime
        self._files = runtime.files
        self._exits = exits
        self.handler_name = runtime.handler_name
        # None: conmon is not watched (tests of the runtime layer that need no watch).
        self._monitors = monitors
        self._oom_watch = oom_watch

    def watch(self, container_id: str) -> None:
        self._watch_oom(container_id)
        conmon = self._files.conmon_ref(container_id)
        if self._monitors is None or conmon is None:
            return

        async def exited() -> None:
            await self._monitor_exited(container_id)

        self._monitors.watch((self.handler_name, container_id), conmon, exited)

    def _watch_oom(self, container_id: str) -> None:
        meta = self._files.read_meta(container_id)
        if self._oom_watch is None or meta is None:
            return
        events = self._runtime.cgroup_layout.oom_events_file(cgroup_dir(meta.cgroups_path))
        if events is not None:
            marker = self._files.containers / container_id / OOM_MARKER
            self._oom_watch.watch((self.handler_name, container_id), events, marker)

    async def forget(self, container_id: str) -> None:
        """Stop watching: the conmon's exit from here on is the caller's doing."""
        if self._oom_watch is not None:
            self._oom_watch.forget((self.handler_name, container_id))
        if self._monitors is not None:
            await self._monitors.forget((self.handler_name, container_id))

    async def _monitor_exited(self, container_id: str) -> None:
        # conmon writes the exit file before it exits: none now means it died first.
        if self._exits.exit_status(container_id) is None and self._files.read_meta(container_id):
            await self.end_unmonitored(container_id)

    async def end_unmonitored(self, container_id: str) -> None:
        """conmon died without recording the container's exit (see the module's
        docstring): the marker, the container killed and deleted in the runtime, then
        the exit file (255) in conmon's place. The container's files stay, as for any
        exited container, until delete(). Idempotent: a restart that finds the marker
        without the exit file runs it again."""
        cdir = self._files.containers / container_id
        marker = cdir / _MONITOR_DIED
        if not marker.exists():
            write_atomic(marker, str(time.time_ns()).encode())
        log.warning(
            "the monitor (conmon) of %s died without recording its exit: deleting the "
            "container from %s and recording exit code %d",
            container_id,
            self.handler_name,
            MONITOR_DIED_EXIT_CODE,
        )
        try:
            await self._runtime.delete_from_runtime(
                container_id, self._files.read_meta(container_id)
            )
        except Exception as err:  # recorded all the same; its removal deletes it again
            log.error("deleting %s, whose monitor died: %s", container_id, err)
        fault_point("container:unmonitored-deleted")
        write_atomic(self._files.exits / container_id, str(MONITOR_DIED_EXIT_CODE).encode())

    def monitor_died(self, container_id: str) -> bool:
        """Whether the container's exit was recorded by end_unmonitored(), not conmon."""
        return (self._files.containers / container_id / _MONITOR_DIED).exists()

    async def adopt(self, states: Mapping[str, str]) -> list[str]:
        """After a restart: watch every conmon still running, and end the containers
        whose conmon died while the daemon was down. `states` is what the runtime lists
        (states()). Returns the IDs of the containers ended."""
        ended = []
        for container_id in sorted(os.listdir(self._files.containers)):
            if self._exits.exit_status(container_id) is not None:
                continue  # exited, recorded by conmon (or by us, before the restart)
            conmon = self._files.conmon_ref(container_id)
            if conmon is None:
                continue  # never reached conmon: a creation that restore rolled back
            if alive(conmon):
                self.watch(container_id)
            elif container_id in states or self.monitor_died(container_id):
                # The runtime still has it (or a crash interrupted its ending): a reboot
                # would have taken both conmon and the runtime's state.
                await self.end_unmonitored(container_id)
                ended.append(container_id)
        return ended
