"""ReopenContainerLog: conmon asked, through its control FIFO, to reopen the log file that
kubelet renamed to rotate it."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from pathlib import Path

from cri_shim.errors import FailedPrecondition, Internal, NotFound
from cri_shim.runtime.handler_runtime import HandlerRuntime

REOPEN_TIMEOUT = 2.0

# conmon's control FIFO message: "<type> <height> <width>\n"; type 2 reopens the log.
_REOPEN_LOG_MESSAGE = b"2 0 0\n"


async def reopen_log(runtime: HandlerRuntime, container_id: str) -> None:
    """Ask conmon to reopen the log file (kubelet renamed it to rotate), and return
    once the new file exists, so that kubelet never compresses a file still written."""
    meta = runtime.files.read_meta(container_id)
    if meta is None:
        raise NotFound(
            f"container {container_id} is not known to runtime handler {runtime.handler_name}"
        )
    log_path = Path(meta.log_path)
    if not log_path.parent.is_dir():
        # conmon cannot open a file there: it would exit without recording the
        # container's exit, and the container be killed as unmonitored.
        raise FailedPrecondition(
            f"the log directory {log_path.parent} of container {container_id} no longer "
            "exists (removed since the container started): its log cannot be reopened "
            "there; the container goes on writing to the file it has open"
        )
    try:
        # Non-blocking: with no reader (conmon gone) open fails with ENXIO instead of
        # hanging for ever.
        fd = os.open(Path(meta.bundle) / "ctl", os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno in (errno.ENXIO, errno.ENOENT):
            raise FailedPrecondition(
                f"container {container_id} is not running; its log is not open"
            ) from None
        raise Internal(f"reopening the log of {container_id}: {err}") from None
    try:
        os.write(fd, _REOPEN_LOG_MESSAGE)
    finally:
        os.close(fd)
    deadline = time.monotonic() + REOPEN_TIMEOUT
    while not _exists(log_path):
        if time.monotonic() > deadline:
            raise Internal(f"conmon did not reopen {log_path} within {REOPEN_TIMEOUT:g}s")
        await asyncio.sleep(0.002)


def _exists(path: Path) -> bool:
    return path.exists()
