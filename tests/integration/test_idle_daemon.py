"""The idle daemon: with no calls coming, its event loop stops waking for the lag
monitor's samples, and the first call starts them again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cri_shim.loop_monitor import IDLE_AFTER
from tests.harness import Daemon, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]


def loop_wakeups(pid: int) -> int:
    """How often the daemon's event loop thread (its main thread) has been switched in."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


def test_the_idle_event_loop_sleeps_until_the_next_call(daemon: Daemon) -> None:
    assert daemon.proc is not None
    before = daemon.status_info()["eventLoop"]
    assert before["pausedWithoutCalls"] == 0  # sampling: the call above just arrived
    time.sleep(IDLE_AFTER + 2)  # no calls: the monitor pauses once the idle time is over
    woke = loop_wakeups(daemon.proc.pid)
    # Samples every 100 ms would wake the loop 50 times in these; what still wakes it
    # (the orphan reaper's scan each second, twice each) comes to about 12.
    time.sleep(5)
    assert loop_wakeups(daemon.proc.pid) - woke < 30
    paused = daemon.status_info()["eventLoop"]  # this call starts the sampling again
    assert paused["pausedWithoutCalls"] == 1
    wait_until(lambda: daemon.status_info()["eventLoop"]["samples"] > paused["samples"])
