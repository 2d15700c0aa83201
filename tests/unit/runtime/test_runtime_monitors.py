"""MonitorWatch: a watched process's exit runs its handler once, through a pidfd; a reused
pid is never taken for the process; a forgotten watch runs nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from cri_shim.runtime.monitors import MonitorWatch, ProcessRef, process_stat
from tests.waiting import until


def _sleeper() -> subprocess.Popen[bytes]:
    """A child to watch (started at once: nothing to wait for)."""
    return subprocess.Popen(["sleep", "30"])


def _ref(pid: int) -> ProcessRef:
    found = process_stat(pid)
    assert found is not None
    return ProcessRef(pid, found[2])


async def test_an_exit_runs_its_handler_once_and_the_child_is_reaped() -> None:
    child = _sleeper()
    watch = MonitorWatch()
    exits: list[str] = []

    async def exited() -> None:
        exits.append("c1")

    watch.watch(("runc", "c1"), _ref(child.pid), exited)
    assert len(watch) == 1 and exits == []
    os.kill(child.pid, signal.SIGKILL)
    await until(lambda: exits)
    await asyncio.sleep(0.05)  # no second run
    assert exits == ["c1"] and len(watch) == 0
    assert process_stat(child.pid) is None  # reaped through the pidfd, not left a zombie
    await watch.aclose()


async def test_a_process_that_reused_the_pid_is_not_watched() -> None:
    child = _sleeper()
    try:
        watch = MonitorWatch()
        exits: list[str] = []

        async def exited() -> None:
            exits.append("gone")

        # The recorded conmon started at another time: this process only has its pid.
        ref = _ref(child.pid)
        watch.watch(("runc", "c1"), ProcessRef(ref.pid, ref.start_time - 1), exited)
        await until(lambda: exits)
        assert len(watch) == 0 and child.poll() is None
        await watch.aclose()
    finally:
        child.kill()
        child.wait()


async def test_a_forgotten_watch_runs_nothing() -> None:
    child = _sleeper()
    watch = MonitorWatch()
    exits: list[str] = []

    async def exited() -> None:
        exits.append("c1")

    watch.watch(("runc", "c1"), _ref(child.pid), exited)
    await watch.forget(("runc", "c1"))
    child.kill()
    child.wait()
    await asyncio.sleep(0.05)
    assert exits == [] and len(watch) == 0
    await watch.aclose()
