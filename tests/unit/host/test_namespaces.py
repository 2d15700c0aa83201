"""Entering a pinned network namespace from a thread, and coming back."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cri_shim.host.libc import check
from cri_shim.host.namespaces import CLONE_NEWNET, netns_entered, setns, unshare


def test_a_failed_call_raises_with_its_errno_and_what_it_was() -> None:
    assert check(3, "fine") == 3
    with pytest.raises(OSError, match="setns: bad fd: Bad file descriptor"):
        setns(-1, 0, "setns: bad fd")


def test_entering_a_namespace_that_is_no_namespace_fails_and_stays_home(tmp_path: Path) -> None:
    not_a_namespace = tmp_path / "file"
    not_a_namespace.write_text("")
    home = os.readlink("/proc/thread-self/ns/net")
    with pytest.raises(OSError, match="enter"), netns_entered(not_a_namespace):
        pass
    assert os.readlink("/proc/thread-self/ns/net") == home


@pytest.mark.root
def test_a_thread_enters_the_namespace_and_returns() -> None:
    daemons = os.readlink("/proc/self/ns/net")
    seen: list[str] = []

    def work() -> None:
        unshare(CLONE_NEWNET)  # this thread only, and it ends right after
        seen.append(os.readlink("/proc/thread-self/ns/net"))
        with netns_entered(Path("/proc/self/ns/net")):  # the main thread's
            seen.append(os.readlink("/proc/thread-self/ns/net"))
        seen.append(os.readlink("/proc/thread-self/ns/net"))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    own, inside, after = seen
    assert own != daemons
    assert inside == daemons
    assert after == own
