"""OOM kills on cgroup v2, seen as they happen and remembered past the cgroup.

A container's exit is reported OOMKilled when the kernel's OOM killer killed a process of
its cgroup. Reading the cgroup's `memory.events` when the exit is recorded is too late
under the systemd driver: the container's cgroup is a scope that systemd made, and
systemd removes it as soon as its last process is gone, often before the daemon records
the exit. So each container's `memory.events` is watched with inotify from its creation
(the kernel signals every change of its counters as a modification of the file), and an
`oom_kill` count above zero leaves a marker file, which the exit's recording reads
(RuntimeBackend.oom_killed) whatever became of the cgroup.

The modification is queued when the kernel kills, before the process has exited and so
before conmon writes the exit file: `drain()`, called before an exit is judged, handles
what is queued even when the exit is noticed first. When the file is gone by the time
the event is read, the parent cgroup's `memory.events` (whose counts include its
children's) decides: its `oom_kill` count above the one last seen beside the
container's says the kill was the container's (or, rarely, a sibling's in that window).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cri_shim.host.inotify import FileWatch
from cri_shim.runtime.stats import read_flat_keyed

log = logging.getLogger(__name__)

# The marker a container's OOM kill leaves in its directory of the runtime's state.
OOM_MARKER = "oom-killed"


@dataclass
class _Watched:
    key: tuple[str, str]  # (handler, container ID)
    marker: Path
    parent_oom_kills: int  # the parent's count when the container's was last read


def oom_kill_count(events_file: Path) -> int | None:
    """`oom_kill` of a memory.events file (None when the file is gone)."""
    return read_flat_keyed(events_file).get("oom_kill")


class OomWatch:
    """One inotify instance on the event loop for every container's `memory.events`,
    keyed by handler and container like the monitors' watch (runtime/monitors.py). A
    watch ends with forget() (the container is deleted), once it has left its marker,
    or when its cgroup is removed."""

    def __init__(self) -> None:
        self._inotify: FileWatch | None = None  # made with the first watch
        self._files: dict[tuple[str, str], Path] = {}
        self._watched: dict[Path, _Watched] = {}

    def __len__(self) -> int:
        return len(self._files)

    def watch(self, key: tuple[str, str], events_file: Path, marker: Path) -> None:
        """Watch `events_file` for an OOM kill, to be recorded as `marker` (replacing a
        watch under `key`). A file that is not there (a runtime that made no cgroup, a
        container already gone) is not watched."""
        self.forget(key)
        inotify = self._started()
        try:
            inotify.add(events_file)
        except OSError as err:
            log.debug("not watching %s for OOM kills: %s", events_file, err)
            return
        # Read after the watch is in place, so that no kill falls between the two. The
        # cgroup is the container's own, made with it: any kill counted is one of its
        # processes (one while the daemon was down, when a restart watches it again).
        self._files[key] = events_file
        self._watched[events_file] = _Watched(
            key, marker, oom_kill_count(_parent_events(events_file)) or 0
        )
        self._changed(events_file, gone=False)

    def forget(self, key: tuple[str, str]) -> None:
        """Stop watching `key`'s file (its container is being deleted)."""
        events_file = self._files.pop(key, None)
        if events_file is None:
            return
        del self._watched[events_file]
        if self._inotify is not None:
            self._inotify.remove(events_file)

    def drain(self) -> None:
        """Handle every change the kernel has queued: call before judging an exit."""
        if self._inotify is None:
            return
        for event in self._inotify.read():
            if event.path is None:
                # Changes were lost: look at every watched file.
                for events_file in list(self._watched):
                    self._changed(events_file, gone=False)
                continue
            if event.path in self._watched:
                self._changed(event.path, gone=event.gone)

    def close(self) -> None:
        """The daemon stops: every watch ends (a restart watches its containers again)."""
        self._files.clear()
        self._watched.clear()
        if self._inotify is not None:
            asyncio.get_running_loop().remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None

    def _started(self) -> FileWatch:
        if self._inotify is None:
            self._inotify = FileWatch()
            asyncio.get_running_loop().add_reader(self._inotify.fileno(), self._readable)
        return self._inotify

    def _readable(self) -> None:
        try:
            self.drain()
        except Exception:  # one bad event must not stop the others being handled
            log.exception("reading the OOM watch failed")

    def _changed(self, events_file: Path, *, gone: bool) -> None:
        watched = self._watched[events_file]
        if gone:
            # Removed with no change left unread: the container ended without a kill.
            self.forget(watched.key)
            return
        parent = oom_kill_count(_parent_events(events_file))
        count = oom_kill_count(events_file)
        if count is not None:
            killed = count > 0
            if parent is not None:
                watched.parent_oom_kills = parent
        else:
            # Changed, then removed before it was read (systemd removed the scope): the
            # parent's count, which includes the container's, tells.
            killed = parent is not None and parent > watched.parent_oom_kills
        if killed:
            _write_marker(watched.marker)
            log.info("%s %s: the OOM killer killed a process of it", *watched.key)
        if killed or count is None:
            # Nothing more to learn: the kill is recorded, or the cgroup is gone.
            self.forget(watched.key)


def _parent_events(events_file: Path) -> Path:
    return events_file.parent.parent / events_file.name


def _write_marker(marker: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # the container's files are gone
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.close(fd)
