"""Reading a small file whose path someone else chose (a request, a spec directory).

Such a path may name a FIFO (whose open would block), a device (`/dev/zero` never ends) or
a file of any size: only a regular file is read, and no more than the caller's limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_small_file(path: str | Path, limit: int, *, follow_symlink: bool = True) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them. OSError when it
    cannot be opened (ELOOP for a symlink when `follow_symlink` is false); ValueError,
    saying why, when it is no regular file or is larger than `limit`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_symlink:
        flags |= os.O_NOFOLLOW
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as stream:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data
