"""inotify(7): which files appeared in a set of directories, or which watched files
changed, as it happens.

conmon records a container's exit by writing `exits/<id>` (a temporary file renamed into
place). Watching those directories tells the daemon of an exit at once, with no polling
and no process per container; the event loop reads the inotify descriptor when the
kernel says it is readable. cgroup v2 signals a change of a counter file (a container's
`memory.events`) the same way, as a modification of that file (FileWatch).
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cri_shim.host.libc import check, last_errno, libc

IN_MODIFY = 0x00000002
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


class _Inotify:
    """One inotify instance: `fileno()` is for the event loop's add_reader; `read()`
    drains what is pending and never blocks. Close it when done (it is a file
    descriptor)."""

    def __init__(self) -> None:
        self._fd: int = int(check(libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1"))

    def fileno(self) -> int:
        return self._fd

    def _read_raw(self) -> Iterator[tuple[int, int, bytes]]:
        """(watch descriptor, mask, name) of everything pending now."""
        try:
            data = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError as err:
            if err.errno == errno.EINTR:
                return
            raise
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size : offset + _HEADER.size + length]
            offset += _HEADER.size + length
            yield wd, mask, raw.rstrip(b"\0")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DirectoryWatch(_Inotify):
    """Some directories, watched for files written or moved in."""

    def __init__(self, directories: list[Path], mask: int = IN_CLOSE_WRITE | IN_MOVED_TO) -> None:
        super().__init__()
        self._watches: dict[int, Path] = {}
        try:
            for directory in directories:
                wd = check(
                    libc.inotify_add_watch(self._fd, os.fsencode(directory), mask | IN_ONLYDIR),
                    f"inotify_add_watch {directory}",
                )
                self._watches[wd] = directory
        except BaseException:
            self.close()
            raise

    def read(self) -> list[InotifyEvent]:
        """Everything pending now (an empty list when nothing is)."""
        return [
            InotifyEvent(self._watches.get(wd), os.fsdecode(name), mask)
            for wd, mask, name in self._read_raw()
            if not mask & IN_IGNORED  # the watched directory itself went away
        ]

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class FileEvent:
    path: Path | None  # None for a queue overflow (events were lost)
    mask: int

    @property
    def overflowed(self) -> bool:
        return bool(self.mask & IN_Q_OVERFLOW)

    @property
    def gone(self) -> bool:
        """The watch ended: the file was removed (or the watch taken off)."""
        return bool(self.mask & IN_IGNORED)


class FileWatch(_Inotify):
    """Single files, each watched for modification from add() until remove() or until
    the file is removed (its last event is then `gone`)."""

    def __init__(self, mask: int = IN_MODIFY) -> None:
        super().__init__()
        self._mask = mask
        self._paths: dict[int, Path] = {}
        self._wds: dict[Path, int] = {}

    def __len__(self) -> int:
        return len(self._wds)

    def add(self, path: Path) -> None:
        """Watch `path` (OSError if it cannot be: FileNotFoundError when it is not there)."""
        wd = check(
            libc.inotify_add_watch(self._fd, os.fsencode(path), self._mask),
            f"inotify_add_watch {path}",
        )
        self._paths[wd] = path
        self._wds[path] = wd

    def remove(self, path: Path) -> None:
        """Stop watching `path` (nothing if it is not watched, or its file is gone)."""
        wd = self._wds.pop(path, None)
        if wd is None:
            return
        del self._paths[wd]
        # EINVAL: the kernel ended the watch already (the file was removed), and its
        # IN_IGNORED is still queued.
        if libc.inotify_rm_watch(self._fd, wd) < 0 and last_errno() != errno.EINVAL:
            check(-1, f"inotify_rm_watch {path}")

    def read(self) -> list[FileEvent]:
        """Everything pending now (an empty list when nothing is); events of files no
        longer watched are left out."""
        events = []
        for wd, mask, _name in self._read_raw():
            if mask & IN_Q_OVERFLOW:
                events.append(FileEvent(None, mask))
                continue
            path = self._paths.get(wd)
            if path is None:
                continue
            if mask & IN_IGNORED:
                del self._paths[wd]
                del self._wds[path]
            events.append(FileEvent(path, mask))
        return events

    def __enter__(self) -> FileWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
