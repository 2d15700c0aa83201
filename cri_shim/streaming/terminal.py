"""The master side of a pseudo-terminal, driven from asyncio: read, write, resize, close."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import struct
import termios

EOT = b"\x04"  # the terminal's EOF character (VEOF) in its default settings


def set_window_size(fd: int, width: int, height: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))


class PtyMaster:
    """Owns a pty master fd. Reading returns b"" once every holder of the slave has gone."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._loop = asyncio.get_running_loop()
        self._eof = False

    @property
    def fd(self) -> int:
        return self._fd

    async def read(self, size: int = 32 * 1024) -> bytes:
        while not self._eof and self._fd >= 0:
            try:
                return os.read(self._fd, size)
            except BlockingIOError:
                await self._wait(readable=True)
            except OSError as exc:
                # Linux answers EIO once the last slave fd is closed: the end of output.
                if exc.errno != errno.EIO:
                    raise
                self._eof = True
        return b""

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._fd < 0:
                raise BrokenPipeError("terminal closed")
            try:
                written = os.write(self._fd, view)
            except BlockingIOError:
                await self._wait(readable=False)
                continue
            view = view[written:]

    def resize(self, width: int, height: int) -> None:
        if self._fd >= 0:
            set_window_size(self._fd, width, height)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    async def _wait(self, *, readable: bool) -> None:
        future: asyncio.Future[None] = self._loop.create_future()

        def ready() -> None:
            if not future.done():
                future.set_result(None)

        fd = self._fd
        if readable:
            self._loop.add_reader(fd, ready)
        else:
            self._loop.add_writer(fd, ready)
        try:
            await future
        finally:
            if readable:
                self._loop.remove_reader(fd)
            else:
                self._loop.remove_writer(fd)
