"""Reaping orphans that a child-subreaper daemon inherits.

With PR_SET_CHILD_SUBREAPER, every orphan below the daemon becomes its child: conmon
monitors (monitors.py reaps those itself, through their pidfds), and anything whose parent
died first, such as a process exec'd into a container whose `runc exec` was killed, or a
container process whose conmon died. Such a zombie is not just a table entry: while it sits
in a container's PID namespace, that namespace cannot finish dying, and `runc delete`
fails with "container init still running" until someone reaps it.

The daemon's own subprocesses must not be reaped here, or their waiters would lose their
exit status. asyncio's watcher reaps a child as soon as it exits (a thread blocked in
waitpid() per child on Python 3.11), and host/spawn.py names the processes its threads
wait for, so a zombie child still there at the next scan, with the same start time and
not spawn's, has nobody else to reap it.

Most scans find nothing: a conmon is reaped by its watch (monitors.py) as soon as it
exits, so a zombie here is rare (a container's process whose conmon died, an exec'd one).
One waitid(WNOWAIT), which reports a zombie child without reaping it, answers whether
there is any at all; only then are the children read from /proc. Reading them every
second cost a daemon with 50 pods 4-6 % of its samples. And the look itself waits for a
child to exit (SIGCHLD): an idle daemon does not wake every second for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from cri_shim.host import spawn
from cri_shim.runtime.monitors import process_stat

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 1.0
# With no child exiting, a look this often all the same (a missed signal).
IDLE_INTERVAL = 60.0


class OrphanReaper:
    """Call scan() periodically (run() does so); it reaps zombies that outlived a scan."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def scan(self) -> list[int]:
        """Reap the zombie children seen at the previous scan too; return their pids."""
        if not _any_zombie_child():
            self._seen = set()
            return []
        current = set(_zombie_children())
        reaped = []
        # The start time is part of the key: a reused pid is a different process.
        waited_for = spawn.owned()
        for pid, _start_time in current & self._seen:
            if pid in waited_for:
                continue
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    reaped.append(pid)
                    log.debug("reaped orphan %d (status %d)", pid, status)
        self._seen = current - {ref for ref in current if ref[0] in reaped}
        return reaped

    async def run(
        self, interval: float = DEFAULT_INTERVAL, idle_interval: float = IDLE_INTERVAL
    ) -> None:
        """Scan for ever; cancel to stop. Own it in the daemon's task group. Whether any
        child is a zombie is one non-blocking call, asked on the event loop; only a scan
        that reads /proc goes to a thread (the loop would otherwise be held for as long
        as it takes to get the interpreter back after every read).

        A look comes `interval` after a child exited (SIGCHLD, on the loop's main thread;
        by then the daemon's own subprocesses are reaped by their waiters) and while a
        zombie waits for its second scan; with no child exiting, only every
        `idle_interval`, in case a signal was missed: an idle daemon does not wake for it."""
        loop = asyncio.get_running_loop()
        child_exited = asyncio.Event()
        try:
            loop.add_signal_handler(signal.SIGCHLD, child_exited.set)
        except (RuntimeError, ValueError):  # not the main thread: poll instead
            idle_interval = interval
        try:
            while True:
                child_exited.clear()  # before the look: an exit after it wakes the next
                if _any_zombie_child() or self._seen:
                    await asyncio.to_thread(self.scan)
                if not self._seen:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(child_exited.wait(), idle_interval)
                await asyncio.sleep(interval)
        finally:
            with contextlib.suppress(RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGCHLD)


def _any_zombie_child() -> bool:
    """Whether a child of this process has exited and is not reaped yet; it stays so
    (WNOWAIT), for whoever waits for it."""
    try:
        found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False  # no children at all
    return found is not None


def _zombie_children() -> list[tuple[int, int]]:
    """(pid, start time) of this process's zombie children."""
    me = os.getpid()
    found = []
    for pid in _children(me):
        stat = process_stat(pid)
        if stat is not None and stat[0] == "Z" and stat[1] == me:
            found.append((pid, stat[2]))
    return found


def _children(me: int) -> list[int]:
    """The pids of this process's children: each thread's `children` file (a child
    belongs to the thread that forked it, an adopted orphan to any of them), or every
    process when the kernel has no such files (CONFIG_PROC_CHILDREN); the caller checks
    the parent. A child missed while the list changes is found at the next scan."""
    if not os.path.exists(f"/proc/{me}/task/{me}/children"):
        return [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]
    pids: list[int] = []
    for thread in os.scandir(f"/proc/{me}/task"):
        try:
            with open(f"{thread.path}/children", "rb") as handle:
                pids.extend(int(pid) for pid in handle.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return pids
