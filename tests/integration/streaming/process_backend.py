"""ProcessTestBackend: a streaming backend for tests whose "containers" are host processes.

It is a test double, not a container runtime: exec runs the command on the host (through
pipes, or a real pty for a TTY), attach connects to a long-running process the test
started with `start_container`, and port-forward dials 127.0.0.1 in the test's own
network namespace. It lets the protocol code be tested without root or runc.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import termios
from dataclasses import dataclass, field

from cri_shim.errors import FailedPrecondition, NotFound
from cri_shim.streaming.terminal import EOT, PtyMaster


def _make_controlling_tty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@dataclass
class HostProcess:
    """A host process with pipes or a pty; implements ExecProcess and AttachSession."""

    process: asyncio.subprocess.Process
    pty: PtyMaster | None
    tty: bool
    resizes: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    async def start(cls, cmd: list[str], *, tty: bool, stdin: bool) -> HostProcess:
        # The terminal size must come from the pty alone: busybox's `stty size` prefers
        # LINES/COLUMNS from the environment, which test runners like to set.
        env = {k: v for k, v in os.environ.items() if k not in ("LINES", "COLUMNS")}
        if tty:
            master, slave = os.openpty()
            try:
                process = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    start_new_session=True,
                    preexec_fn=_make_controlling_tty,
                    env=env,
                )
            finally:
                os.close(slave)
            return cls(process, PtyMaster(master), tty=True)
        process = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        return cls(process, None, tty=False)

    async def write_stdin(self, data: bytes) -> None:
        if self.pty is not None:
            await self.pty.write(data)
            return
        if self.process.stdin is None:
            raise BrokenPipeError("stdin was not requested")
        self.process.stdin.write(data)
        await self.process.stdin.drain()

    async def close_stdin(self) -> None:
        if self.pty is not None:
            await self.pty.write(EOT)
        elif self.process.stdin is not None:
            self.process.stdin.close()

    async def read_stdout(self) -> bytes:
        if self.pty is not None:
            return await self.pty.read()
        assert self.process.stdout is not None
        return await self.process.stdout.read(32 * 1024)

    async def read_stderr(self) -> bytes:
        if self.pty is not None:
            return b""
        assert self.process.stderr is not None
        return await self.process.stderr.read(32 * 1024)

    async def resize(self, width: int, height: int) -> None:
        self.resizes.append((width, height))
        if self.pty is not None:
            self.pty.resize(width, height)

    async def wait(self) -> int:
        code = await self.process.wait()
        return 128 - code if code < 0 else code

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        if self.pty is not None:
            self.pty.close()

    async def detach(self) -> None:
        """Attach sessions let go without stopping the process."""


class ProcessTestBackend:
    """Implements StreamingBackend with host processes; see the module docstring."""

    def __init__(self) -> None:
        self.containers: dict[str, HostProcess] = {}
        self.execs: list[HostProcess] = []
        self.dialed: list[tuple[str, int]] = []

    async def start_container(self, container_id: str, cmd: list[str], *, tty: bool) -> HostProcess:
        process = await HostProcess.start(cmd, tty=tty, stdin=True)
        self.containers[container_id] = process
        return process

    async def exec(self, container_id: str, cmd: list[str], tty: bool, stdin: bool) -> HostProcess:
        if container_id == "missing":
            raise NotFound(f"container {container_id} not found")
        process = await HostProcess.start(cmd, tty=tty, stdin=stdin)
        self.execs.append(process)
        return process

    async def attach(self, container_id: str, tty: bool, stdin: bool) -> HostProcess:
        process = self.containers.get(container_id)
        if process is None:
            raise NotFound(f"container {container_id} not found")
        if process.process.returncode is not None:
            raise FailedPrecondition(f"container {container_id} is not running")
        return process

    async def port_forward(
        self, sandbox_id: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.dialed.append((sandbox_id, port))
        return await asyncio.open_connection("127.0.0.1", port)

    async def close(self) -> None:
        for process in [*self.execs, *self.containers.values()]:
            await process.kill()
