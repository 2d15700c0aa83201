"""Waiting in tests for a condition, with a deadline, rather than for a guessed time.

A test that sleeps "long enough" is slow when the guess is generous and flaky when the
machine is busy; these poll what the test is about (a file, a line in a log, a process
gone) and fail with the condition's name once the deadline has passed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# Every wait_until deadline is multiplied by this: an emulated guest (scripts/guest, whose
# lane sets 4) runs everything several times slower than a host.
TIME_SCALE = float(os.environ.get("CRI_SHIM_TEST_TIME_SCALE", "1"))


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05) -> T:
    """`predicate()` once it is truthy; `TimeoutError` after `timeout` seconds. For what
    a test polls over RPC or in another process, hence the longer interval."""
    timeout *= TIME_SCALE
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_name(predicate)}: not reached within {timeout}s")
        time.sleep(interval)
    return value


async def until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Like `wait_until`, without blocking the event loop. Polling on purpose: the states a
    test watches (a process exit, a file written by a child) have no event on its side."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_name(predicate)}: not reached within {timeout}s")
        await asyncio.sleep(interval)
    return value


def _name(predicate: Callable[..., object]) -> str:
    return getattr(predicate, "__qualname__", repr(predicate))
