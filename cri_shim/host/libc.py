"""The one handle on the C library, and the errno check every system call goes through."""

from __future__ import annotations

import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
libc.inotify_init1.argtypes = [ctypes.c_int]
libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
libc.syscall.restype = ctypes.c_long


def last_errno() -> int:
    """The errno of the last failed call made through `libc` in this thread."""
    return ctypes.get_errno()


def check(result: int, what: str) -> int:
    """`result` if the call succeeded; else OSError(errno, "<what>: <strerror>")."""
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result
