"""Namespaces of the calling thread: unshare(2), setns(2), sethostname(2).

Each changes only the calling thread (the daemon is multithreaded), so the callers run
them in a thread of their own and return it to where it started (DESIGN §6).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from cri_shim.host.libc import check, libc

CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000


def unshare(flags: int) -> None:
    check(libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int, what: str = "setns") -> None:
    check(libc.setns(fd, nstype), what)


def sethostname(name: bytes) -> None:
    check(libc.sethostname(name, len(name)), "sethostname")


@contextlib.contextmanager
def netns_entered(netns: Path) -> Iterator[None]:
    """The calling thread inside the network namespace pinned at `netns` for the block,
    then back in the one it was in. Should the way back fail, the thread stays in the
    pod's namespace: call this only from a thread that ends right after."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(target, CLONE_NEWNET, f"setns: enter {netns}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            setns(home, CLONE_NEWNET, "setns: return to the daemon's network namespace")
    finally:
        os.close(home)
