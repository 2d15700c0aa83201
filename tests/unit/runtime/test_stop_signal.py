"""Which stop signals the kernel discarded, read from a real process's status file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from cri_shim.runtime.stop_signal import catches, discarded_by_init


def test_a_handler_is_seen_and_a_process_outside_a_namespace_of_its_own_is_no_init() -> None:
    # Python installs a SIGINT handler; it has none for SIGUSR2.
    assert catches(os.getpid(), signal.SIGINT) is True
    assert catches(os.getpid(), signal.SIGUSR2) is False
    # Not the init of its PID namespace: the kernel delivers even an uncaught signal.
    assert discarded_by_init(os.getpid(), signal.SIGUSR2) is False


def test_a_gone_process_neither_catches_nor_discards() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert catches(child.pid, signal.SIGTERM) is None
    assert discarded_by_init(child.pid, signal.SIGTERM) is False
