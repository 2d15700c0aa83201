"""OrphanReaper: orphans re-parented to a subreaper are reaped; asyncio's children are not.

Each case runs in a fresh interpreter, because being a child subreaper changes the test
process for good.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import asyncio, ctypes, os, sys, time
    from cri_shim.runtime.orphans import OrphanReaper
    from tests.waiting import until

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

    def zombie_state(pid):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0].decode()
        except FileNotFoundError:
            return "gone"

    async def main():
        # An orphan: a child forks a grandchild and exits at once, so the grandchild is
        # re-parented to us; it then exits and stays a zombie until reaped.
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            grandchild = os.fork()
            if grandchild == 0:
                time.sleep(0.2)  # outlives its parent, so it is re-parented to us alive
                os._exit(0)
            os.write(write, str(grandchild).encode())
            os._exit(0)
        os.waitpid(middle, 0)
        orphan = int(os.read(read, 32))
        await until(lambda: zombie_state(orphan) == "Z")

        reaper = OrphanReaper()
        assert reaper.scan() == []  # seen once: might still be someone else's to reap
        # Meanwhile asyncio's own children keep their exit status.
        procs = [await asyncio.create_subprocess_exec("sh", "-c", f"exit {n}")
                 for n in range(1, 6)]
        codes = [await p.wait() for p in procs]
        assert reaper.scan() == [orphan]
        assert zombie_state(orphan) == "gone"
        assert codes == [1, 2, 3, 4, 5], codes
        print("ok")

    asyncio.run(main())
    """
)


def _run(script: str) -> str:
    """`script` in a fresh interpreter; what it printed."""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_orphans_are_reaped_and_asyncio_children_keep_their_status() -> None:
    assert _run(SCRIPT) == "ok"


SPAWNED = textwrap.dedent(
    """
    import asyncio, ctypes
    from cri_shim.host import spawn
    from cri_shim.runtime.orphans import OrphanReaper

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

    async def main():
        # The shell exits at once, but the sleep it left behind holds its stdout: the
        # thread waiting for it reads until that closes, so the shell stays a zombie
        # across two scans.
        run = asyncio.create_task(spawn.run(["sh", "-c", "sleep 1 & exit 7"], timeout=10))
        reaper = OrphanReaper()
        while not run.done():
            reaper.scan()
            await asyncio.sleep(0.1)
        print(run.result().returncode)

    asyncio.run(main())
    """
)


def test_a_spawned_process_keeps_its_exit_status_while_it_waits_for_its_output() -> None:
    assert _run(SPAWNED) == "7"


NOTHING_TO_REAP = textwrap.dedent(
    """
    import os, time
    from cri_shim.runtime import orphans
    from tests.waiting import wait_until

    reads = []
    read_children = orphans._zombie_children
    orphans._zombie_children = lambda: reads.append(1) or read_children()

    # No child at all, then a child that runs: neither makes a scan read /proc.
    reaper = orphans.OrphanReaper()
    assert reaper.scan() == [] and reads == [], reads
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    assert reaper.scan() == [] and reaper.scan() == [] and reads == [], reads
    os.kill(child, 9)
    # Once it is a zombie the scans look, and the second reaps it (it is not spawn's).
    wait_until(orphans._any_zombie_child)
    assert reaper.scan() == []
    assert reaper.scan() == [child]
    assert len(reads) == 2, reads
    assert not orphans._any_zombie_child()
    print("ok")
    """
)


def test_a_scan_reads_proc_only_when_a_child_is_a_zombie() -> None:
    assert _run(NOTHING_TO_REAP) == "ok"


LEFT_FOR_ITS_WAITER = textwrap.dedent(
    """
    import os
    from cri_shim.runtime import orphans
    from tests.waiting import wait_until

    child = os.fork()
    if child == 0:
        os._exit(3)
    wait_until(orphans._any_zombie_child)
    assert orphans._any_zombie_child()  # asked twice: still there, not reaped
    pid, status = os.waitpid(child, 0)
    print(pid == child, os.waitstatus_to_exitcode(status))
    """
)


def test_the_zombie_check_leaves_the_exit_status_to_whoever_waits() -> None:
    assert _run(LEFT_FOR_ITS_WAITER) == "True 3"


IDLE_LOOKS = textwrap.dedent(
    """
    import asyncio
    from cri_shim.runtime import orphans

    hops = []

    async def counted(function, *args):
        hops.append(function)
        return function(*args)

    async def main():
        orphans.asyncio.to_thread = counted
        looks = asyncio.create_task(orphans.OrphanReaper().run(interval=0.01))
        await asyncio.sleep(0.2)
        looks.cancel()
        print(len(hops))

    asyncio.run(main())
    """
)


def test_with_no_zombie_a_look_stays_on_the_event_loop() -> None:
    # No child has exited: twenty looks, not one of them handed to a worker thread.
    assert _run(IDLE_LOOKS) == "0"


WOKEN_BY_AN_EXIT = textwrap.dedent(
    """
    import asyncio, ctypes, os, time
    from cri_shim.runtime import orphans
    from tests.waiting import until

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

    looks = []
    any_zombie = orphans._any_zombie_child
    orphans._any_zombie_child = lambda: looks.append(1) or any_zombie()

    def gone(pid):
        return not os.path.exists(f"/proc/{pid}")

    async def main():
        # An hour between looks unless a child exits: idle, the reaper looks once.
        reaper = asyncio.create_task(orphans.OrphanReaper().run(interval=0.05, idle_interval=3600))
        await asyncio.sleep(0.5)
        assert len(looks) == 1, looks
        # An orphan re-parented to us exits: its SIGCHLD wakes the reaper, which reaps it.
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            grandchild = os.fork()
            if grandchild == 0:
                time.sleep(0.2)
                os._exit(0)
            os.write(write, str(grandchild).encode())
            os._exit(0)
        os.waitpid(middle, 0)
        orphan = int(os.read(read, 32))
        await until(lambda: gone(orphan), timeout=10)
        assert len(looks) > 1, looks
        reaper.cancel()
        print("ok")

    asyncio.run(main())
    """
)


def test_an_idle_reaper_sleeps_until_a_child_exits() -> None:
    assert _run(WOKEN_BY_AN_EXIT) == "ok"
