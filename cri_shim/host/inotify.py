"""inotify(7): which files appeared in a set of directories, as it happens.

conmon records a container's exit by writing `exits/<id>` (a temporary file renamed into
place). Watching those directories tells the daemon of an exit at once, with no polling
and no process per container; the event loop reads the inotify descriptor when the
kernel says it is readable.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cri_shim.host.libc import check, libc

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

# struct inotify_event { int wd; uint32_t mask; uint32_t cookie; uint32_t len; char name[]; }
_HEADER = struct.Struct("iIII")
# Room for many events per read: a burst of exits is drained in one system call.
_READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class InotifyEvent:
    directory: Path | None  # None for a queue overflow (events were lost)
    name: str
    mask: int

    @property
    def overflowed(self) -> bool:
        return bool(self.mask & IN_Q_OVERFLOW)


class DirectoryWatch:
    """One inotify instance watching some directories for files written or moved in.

    `fileno()` is for the event loop's add_reader; `read()` drains what is pending and
    never blocks. Close it when done (it is a file descriptor).
    """

    def __init__(self, directories: list[Path], mask: int = IN_CLOSE_WRITE | IN_MOVED_TO) -> None:
        fd = check(libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        self._fd: int = int(fd)
        self._watches: dict[int, Path] = {}
        try:
            for directory in directories:
                wd = check(
                    libc.inotify_add_watch(fd, os.fsencode(directory), mask | IN_ONLYDIR),
                    f"inotify_add_watch {directory}",
                )
                self._watches[wd] = directory
        except BaseException:
            os.close(fd)
            raise

    def fileno(self) -> int:
        return self._fd

    def read(self) -> list[InotifyEvent]:
        """Everything pending now (an empty list when nothing is)."""
        try:
            data = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return []
        except OSError as err:
            if err.errno == errno.EINTR:
                return []
            raise
        return list(self._parse(data))

    def _parse(self, data: bytes) -> Iterator[InotifyEvent]:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size : offset + _HEADER.size + length]
            offset += _HEADER.size + length
            if mask & IN_IGNORED:
                continue  # the watched directory itself went away
            name = os.fsdecode(raw.rstrip(b"\0"))
            yield InotifyEvent(self._watches.get(wd), name, mask)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
