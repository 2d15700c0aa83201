"""conmon processes: known by pid and start time, and watched until they exit.

conmon records a container's exit in its exit file. When conmon itself dies (killed,
OOM-killed), nobody does: the container runs on with nothing holding its log or waiting for
its exit. containerd treats a shim that dies as its task's exit (the runtime's container
force-deleted, an exit published with status 255); CRI-O reports 255 for a container whose
exit was not recorded. So each conmon is watched through a pidfd, which the event loop is
told of once the process has exited: no polling, and no mistaking a process that reused its
pid, since the fd names the process. What an exit means is the watcher's caller's to decide
(RuntimeBackend: nothing when the exit file is there, else the container is ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# What runs once a watched process has exited.
OnExit = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class ProcessRef:
    """A process by pid and start time, so that a reused pid is never mistaken for it."""

    pid: int
    start_time: int


def process_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of a process, or None if gone (or
    its stat cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    # After the command name: state, ppid, ..., starttime is field 22 of the whole line.
    return fields[0].decode(), int(fields[1]), int(fields[19])


def alive(ref: ProcessRef) -> bool:
    found = process_stat(ref.pid)
    return found is not None and found[2] == ref.start_time and found[0] not in ("Z", "X")


class MonitorWatch:
    """One pidfd per watched process, on the event loop. When one becomes readable the
    process has exited: it is reaped if it is the daemon's child (conmon is re-parented to
    the subreaper daemon), and its `on_exit` runs as a task this watch owns. Keys name
    what is watched (a handler and a container)."""

    def __init__(self) -> None:
        self._pidfds: dict[tuple[str, str], int] = {}
        self._exits: dict[tuple[str, str], asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._pidfds)

    def watch(self, key: tuple[str, str], ref: ProcessRef, on_exit: OnExit) -> None:
        """Watch `ref` under `key` (replacing a watch under it). A process already gone
        runs `on_exit` at once."""
        self._unwatch(key)
        try:
            pidfd = os.pidfd_open(ref.pid)
        except ProcessLookupError:
            self._exited(key, on_exit)
            return
        if not alive(ref):  # checked after opening, so that the fd is this very process
            os.close(pidfd)
            self._exited(key, on_exit)
            return
        self._pidfds[key] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._readable, key, pidfd, on_exit)

    async def forget(self, key: tuple[str, str]) -> None:
        """Stop watching `key` (what it watches is being taken down), after the exit that
        is being handled, if one is."""
        self._unwatch(key)
        handling = self._exits.get(key)
        if handling is not None:
            await asyncio.wait([handling])

    async def aclose(self) -> None:
        """The daemon stops: the watches end (a restart adopts the processes again) and
        the exits being handled are waited for."""
        for key in list(self._pidfds):
            self._unwatch(key)
        if self._exits:
            await asyncio.wait(list(self._exits.values()))

    def _readable(self, key: tuple[str, str], pidfd: int, on_exit: OnExit) -> None:
        if self._pidfds.get(key) != pidfd:
            return
        with contextlib.suppress(ChildProcessError):
            # Reaped through the fd, so never another process that reused the pid.
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
        self._unwatch(key)
        self._exited(key, on_exit)

    def _exited(self, key: tuple[str, str], on_exit: OnExit) -> None:
        task = asyncio.get_running_loop().create_task(self._run(key, on_exit))
        self._exits[key] = task

    async def _run(self, key: tuple[str, str], on_exit: OnExit) -> None:
        try:
            await on_exit()
        except Exception:  # one exit must not stop the others being handled
            log.exception("handling the exit of the monitor of %s failed", key[1])
        finally:
            if self._exits.get(key) is asyncio.current_task():
                del self._exits[key]

    def _unwatch(self, key: tuple[str, str]) -> None:
        pidfd = self._pidfds.pop(key, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
