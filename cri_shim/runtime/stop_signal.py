"""A stop signal sent before the container's first process was ready for it.

A container's first process is usually the init of its PID namespace, and the kernel
discards a signal sent to such a process when it neither catches nor ignores it. A
StopContainer that arrives a moment after StartContainer (critest's stop specs, a pod
deleted as it starts) can therefore reach a shell or server before it set its SIGTERM
handler: the signal is lost and the container waits out the whole grace period before
SIGKILL, and exits 137 instead of by its own handler. When the status file shows that
the signal just sent was discarded this way, the signal is sent again as soon as the
process catches it, once, as if it had arrived a moment later. A process that never
installs a handler is killed at the end of the grace period, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

POLL = 0.05  # seconds between looks at the process's handlers


def _status_fields(pid: int) -> dict[str, str] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _has(mask: str, sig: int) -> bool:
    return bool(int(mask or "0", 16) >> (sig - 1) & 1)


def discarded_by_init(pid: int, sig: int) -> bool:
    """Whether `sig`, just sent to `pid`, was discarded: `pid` is the init of its PID
    namespace (the last `NSpid` is 1) and neither catches nor ignores `sig`."""
    fields = _status_fields(pid)
    if fields is None:
        return False
    namespace_pids = fields.get("NSpid", "").split()
    if not namespace_pids or namespace_pids[-1] != "1":
        return False
    return not _has(fields.get("SigCgt", ""), sig) and not _has(fields.get("SigIgn", ""), sig)


def catches(pid: int, sig: int) -> bool | None:
    """Whether `pid` has a handler for `sig`; None once the process is gone."""
    fields = _status_fields(pid)
    return None if fields is None else _has(fields.get("SigCgt", ""), sig)


async def send_again_once_caught(pid: int, sig: int, send: Callable[[], Awaitable[object]]) -> bool:
    """Wait until `pid` catches `sig`, then call `send` once. False if the process went
    first. Cancel it when the container has stopped."""
    while True:
        await asyncio.sleep(POLL)
        caught = await asyncio.to_thread(catches, pid, sig)
        if caught is None:
            return False
        if caught:
            await send()
            return True
