"""FakeSystemdBus: a stand-in for the system bus with systemd's manager behind it, for
tests of the D-Bus calls (host/systemd_manager.py) and of what calls them. A fake, no
socket: it answers as systemd does (a job path, then JobRemoved with the job's result;
NoSuchUnit for a unit it does not know) and keeps the units it was asked to start."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from dbus_fast import Message

from cri_shim.host.systemd_manager import MANAGER, NO_SUCH_UNIT, SystemdManager


class FakeSystemdBus:
    """A stand-in for the system bus with systemd behind it (a fake: no socket)."""

    def __init__(self, job_result: str = "done") -> None:
        self.calls: list[Message] = []
        self.units: dict[str, dict[str, Any]] = {}
        self.job_result = job_result
        self.connected = True
        self._handlers: list[Callable[[Message], Any]] = []
        self._jobs = 0

    def add_message_handler(self, handler: Callable[[Message], Any]) -> None:
        self._handlers.append(handler)

    def disconnect(self) -> None:
        self.connected = False

    async def call(self, message: Message) -> Message:
        self.calls.append(message)
        message.serial = len(self.calls)  # the real bus numbers what it sends
        if message.member == "StartTransientUnit":
            unit, _mode, properties, _aux = message.body
            self.units[unit] = {name: value.value for name, value in properties}
            return self._job(message, unit)
        if message.member == "StopUnit":
            unit = message.body[0]
            if self.units.pop(unit, None) is None:
                return Message.new_error(message, NO_SUCH_UNIT, f"Unit {unit} not loaded.")
            return self._job(message, unit)
        return Message.new_method_return(message)

    def _job(self, message: Message, unit: str) -> Message:
        self._jobs += 1
        job = f"/org/freedesktop/systemd1/job/{self._jobs}"
        removed = Message.new_signal(
            "/org/freedesktop/systemd1",
            MANAGER,
            "JobRemoved",
            "uoss",
            [self._jobs, job, unit, self.job_result],
        )
        # systemd answers first and signals the job's end after.
        asyncio.get_running_loop().call_soon(lambda: [h(removed) for h in self._handlers])
        return Message.new_method_return(message, "o", [job])


def manager_on(bus: FakeSystemdBus) -> SystemdManager:
    async def connect() -> FakeSystemdBus:
        return bus

    return SystemdManager(connect)
