"""What the streaming server needs from a runtime: run a command, attach, dial a port.

The server speaks the wire protocols; a backend only moves bytes to and from a process or
a socket. `runc_backend.RuncStreamingBackend` is the real one. Errors are raised as
`cri_shim.errors` types (`NotFound`, `FailedPrecondition`, ...) or `OSError` for a port
that refuses; the server reports them on the stream's error channel.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cri_shim.runtime.kinds.base import KillInside


@dataclass(frozen=True)
class ContainerEndpoint:
    """What the backend needs to reach one container."""

    runtime_path: Path
    runtime_root: Path
    attach_socket: Path  # `attach` in the container's bundle (its path may be long)
    control_fifo: Path  # the bundle's `ctl` FIFO
    running: bool
    # Options of `exec` before the container's ID (runsc's: the container's user).
    exec_options: tuple[str, ...] = ()
    # How the command is killed where it runs in the runtime's own kernel (gVisor's runsc),
    # not as a host process; None for a host process.
    inside: KillInside | None = None
    # What `exec --detach` with a console socket needs for a terminal (runc's `--tty`).
    tty_options: tuple[str, ...] = ("--tty",)


class StdioSession(Protocol):
    """The standard streams of a process, seen from outside it."""

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None:
        """End of input. With a TTY this sends the terminal's EOF character instead."""

    async def read_stdout(self) -> bytes:
        """The next output chunk, or b"" at the end. With a TTY this carries everything."""

    async def read_stderr(self) -> bytes:
        """The next error chunk, or b"" at the end (at once with a TTY)."""

    async def resize(self, width: int, height: int) -> None: ...


class ExecProcess(StdioSession, Protocol):
    """A command started in a container for one exec request."""

    async def wait(self) -> int:
        """The exit code (128 + signal number for a process killed by a signal)."""

    async def kill(self) -> None:
        """Kill the command (the client went away). Safe to call after it exited."""


class AttachSession(StdioSession, Protocol):
    """A connection to the standard streams of a container's main process."""

    async def detach(self) -> None:
        """Let go of the streams; the container keeps running."""


class StreamingBackend(Protocol):
    async def exec(
        self, container_id: str, cmd: list[str], tty: bool, stdin: bool
    ) -> ExecProcess: ...

    async def attach(self, container_id: str, tty: bool, stdin: bool) -> AttachSession: ...

    async def port_forward(
        self, sandbox_id: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to 127.0.0.1:port inside the sandbox's network namespace."""
        ...
