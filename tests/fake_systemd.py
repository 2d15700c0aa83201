"""Fakes of systemd's manager on the system bus, for tests of the D-Bus calls
(host/systemd_manager.py) and of what calls them; both named as fakes.

- FakeSystemdBus: in the process, no socket. It answers as systemd does (a job path, then
  JobRemoved with the job's result; NoSuchUnit for a unit it does not know; its version)
  and keeps the units it was asked to start, with the process behind each pid or pidfd.
- FakeBusSocket: a unix socket that speaks the bus's wire protocol, for what only a socket
  shows (authentication, unix fds passed, a bus that accepts and never answers). How much
  it answers is chosen: nothing (connections wait in its backlog, never accepted, as with
  dbus.socket whose broker is gone), the authentication only, the connection's set-up
  only (systemd's own calls never answered, a wedged PID 1), or everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbus_fast import Message, Variant
from dbus_fast._private.unmarshaller import Unmarshaller

from cri_shim.host.systemd_manager import (
    JOB,
    MANAGER,
    NO_SUCH_UNIT,
    PROPERTIES,
    UNIT,
    SystemdManager,
    connect_system_bus,
)


def pid_of_pidfd(fd: int) -> int:
    """The process a pidfd refers to, as systemd finds it (-1: it has exited)."""
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    raise AssertionError(f"fd {fd} is not a pidfd")


class _Systemd:
    """What both fakes answer, message by message: systemd's manager behind a bus."""

    def __init__(self, job_result: str, version: str) -> None:
        self.calls: list[Message] = []
        self.units: dict[str, dict[str, Any]] = {}
        # The type of the job queued for a unit ("" none), as GetUnit and the unit's and
        # job's properties tell it; a unit named here is loaded.
        self.queued: dict[str, str] = {}
        self.job_result = job_result
        self.version = version
        self._jobs = 0

    def answer(self, message: Message, fds: list[int]) -> tuple[Message, Message | None]:
        """The reply to a call, and the signal that follows it (a job's end)."""
        self.calls.append(message)
        if message.member == "StartTransientUnit":
            unit, _mode, properties, _aux = message.body
            self.units[unit] = {name: value.value for name, value in properties}
            if "PIDFDs" in self.units[unit]:  # indexes into the message's fds
                self.units[unit]["PIDFDs"] = [
                    pid_of_pidfd(fds[i]) for i in self.units[unit]["PIDFDs"]
                ]
            return self._job(message, unit)
        if message.member == "StopUnit":
            unit = message.body[0]
            if self.units.pop(unit, None) is None:
                return Message.new_error(message, NO_SUCH_UNIT, f"Unit {unit} not loaded."), None
            return self._job(message, unit)
        if message.interface == PROPERTIES and message.body == [MANAGER, "Version"]:
            return Message.new_method_return(message, "v", [Variant("s", self.version)]), None
        if message.member == "GetUnit":
            unit = message.body[0]
            if unit not in self.queued:
                return Message.new_error(message, NO_SUCH_UNIT, f"Unit {unit} not loaded."), None
            path = f"/unit/{list(self.queued).index(unit)}"  # no dot or dash in a path
            return Message.new_method_return(message, "o", [path]), None
        if message.interface == PROPERTIES and message.body == [UNIT, "Job"]:
            queued = list(self.queued.values())[int(message.path.removeprefix("/unit/"))]
            job = [7, f"/job/{queued}"] if queued else [0, "/"]
            return Message.new_method_return(message, "v", [Variant("(uo)", job)]), None
        if message.interface == PROPERTIES and message.body == [JOB, "JobType"]:
            queued = message.path.removeprefix("/job/")
            return Message.new_method_return(message, "v", [Variant("s", queued)]), None
        if message.member == "Hello":
            return Message.new_method_return(message, "s", [":1.42"]), None
        return Message.new_method_return(message), None

    def _job(self, message: Message, unit: str) -> tuple[Message, Message]:
        self._jobs += 1
        job = f"/org/freedesktop/systemd1/job/{self._jobs}"
        removed = Message.new_signal(
            "/org/freedesktop/systemd1",
            MANAGER,
            "JobRemoved",
            "uoss",
            [self._jobs, job, unit, self.job_result],
        )
        return Message.new_method_return(message, "o", [job]), removed


class FakeSystemdBus(_Systemd):
    """A stand-in for the system bus with systemd behind it (a fake: no socket)."""

    def __init__(self, job_result: str = "done", version: str = "252.39-1~deb12u1") -> None:
        super().__init__(job_result, version)
        self.connected = True
        self._handlers: list[Callable[[Message], Any]] = []

    def add_message_handler(self, handler: Callable[[Message], Any]) -> None:
        self._handlers.append(handler)

    def disconnect(self) -> None:
        self.connected = False

    async def call(self, message: Message) -> Message:
        message.serial = len(self.calls) + 1  # the real bus numbers what it sends
        reply, signal = self.answer(message, message.unix_fds)
        if signal is not None:
            # systemd answers first and signals the job's end after.
            asyncio.get_running_loop().call_soon(lambda: [h(signal) for h in self._handlers])
        return reply


def manager_on(bus: FakeSystemdBus) -> SystemdManager:
    async def connect() -> FakeSystemdBus:
        return bus

    return SystemdManager(connect)


NOTHING, AUTH, SETUP, EVERYTHING = "nothing", "auth", "setup", "everything"
# What the connection's set-up calls (SystemdManager._open), answered in SETUP.
_SETUP = {"Hello", "AddMatch", "Subscribe", "Get"}


class FakeBusSocket(_Systemd):
    """A fake of the system bus on a unix socket, answering as far as `answers` says
    (module docstring); each accepted connection is served by a thread of its own."""

    def __init__(
        self, path: Path, answers: str, job_result: str = "done", version: str = "252"
    ) -> None:
        super().__init__(job_result, version)
        self.path = path
        self.answers = answers
        self.address = f"unix:path={path}"
        self.accepted = 0
        self.closed_by_client = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(16)
        self._threads: list[threading.Thread] = []
        self._connections: list[socket.socket] = []
        self._serial = 0
        if answers != NOTHING:
            self._start(self._accept_each)

    def manager(self, **bounds: float) -> SystemdManager:
        async def connect() -> Any:
            return await connect_system_bus(self.address)

        return SystemdManager(connect, **bounds)

    def backlog(self) -> list[bool]:
        """For NOTHING: accept what waited in the backlog, and tell of each connection
        whether its client has closed it."""
        self._listener.setblocking(False)
        closed = []
        with contextlib.suppress(BlockingIOError):
            while True:
                connection, _ = self._listener.accept()
                self._connections.append(connection)
                closed.append(_closed_by_peer(connection))
        return closed

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
        for connection in self._connections:
            connection.close()
        self.path.unlink(missing_ok=True)

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_each(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            self._connections.append(connection)
            self._start(self._serve, connection)

    def _serve(self, connection: socket.socket) -> None:
        try:
            _authenticate(connection)
            messages = Unmarshaller(sock=connection, negotiate_unix_fd=True)
            while True:
                message = messages.unmarshall()
                if message is None:
                    continue  # a part of a message: read on
                if self.answers == EVERYTHING or (
                    self.answers == SETUP and message.member in _SETUP
                ):
                    self._send_answer(connection, message)
                for fd in message.unix_fds:
                    os.close(fd)
        except (EOFError, ConnectionError):
            self.closed_by_client += 1
        except OSError:
            pass  # closed by close()

    def _send_answer(self, connection: socket.socket, message: Message) -> None:
        reply, signal = self.answer(message, message.unix_fds)
        for sent in (reply, signal):
            if sent is not None:
                self._serial += 1
                sent.serial = self._serial
                connection.sendall(sent._marshall(False))


def _authenticate(connection: socket.socket) -> None:
    """The server's side of SASL EXTERNAL, unix fds agreed; AUTH answers no more."""
    line = b""
    while True:
        byte = connection.recv(1)
        if not byte:
            raise EOFError
        line += byte
        if not line.endswith(b"\r\n"):
            continue
        command, line = line.strip(b"\0\r\n"), b""
        if command.startswith(b"AUTH"):
            connection.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
        elif command == b"NEGOTIATE_UNIX_FD":
            connection.sendall(b"AGREE_UNIX_FD\r\n")
        elif command == b"BEGIN":
            return


def _closed_by_peer(connection: socket.socket) -> bool:
    connection.setblocking(False)
    try:
        while connection.recv(4096):
            pass
    except BlockingIOError:
        return False
    return True
