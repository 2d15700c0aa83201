"""systemd's manager over D-Bus: transient scopes for the daemon's own processes.

With the systemd cgroup driver, conmon must not stay in cri-shim.service's cgroup (a
unit whose cgroup systemd manages while the runtime writes below it), nor be a process of
a slice systemd knows nothing of: like CRI-O, each conmon is moved into a transient scope
of its own (`cri-shim-conmon-<id>.scope`) in the slice `conmon_cgroup` names. systemd
removes a scope once its last process has exited, so a conmon's scope goes with it; an
explicit stop is there for a scope a failed create leaves (and runc's container scopes).

The protocol is dbus-fast's (asyncio), imported on first use only: a daemon with the
cgroupfs driver never loads it (its import costs 1.1 MiB of Python objects, 3.4 MiB of
RSS with its compiled modules, measured with tracemalloc).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cri_shim.errors import Internal

log = logging.getLogger(__name__)

DESTINATION = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
# How long a job (a scope's start, a unit's stop) may take before the call fails.
JOB_TIMEOUT = 10.0


class Bus(Protocol):
    """What this module uses of dbus_fast.aio.MessageBus (a fake in the tests)."""

    async def call(self, message: Any) -> Any: ...

    def add_message_handler(self, handler: Callable[[Any], Any]) -> None: ...

    def disconnect(self) -> None: ...

    @property
    def connected(self) -> bool: ...


async def connect_system_bus() -> Bus:
    from dbus_fast import BusType
    from dbus_fast.aio import MessageBus

    bus: Bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    return bus


def scope_properties(slice_name: str, pid: int, description: str) -> list[list[Any]]:
    """StartTransientUnit's properties (a(sv)) of a scope holding `pid` in `slice_name`:
    no default dependencies (a scope must not wait for, or stop with, basic.target), and
    collected when it ends, even failed, so that no unit is left behind."""
    from dbus_fast import Variant

    return [
        ["Description", Variant("s", description)],
        ["Slice", Variant("s", slice_name)],
        ["PIDs", Variant("au", [pid])],
        ["Delegate", Variant("b", True)],
        ["DefaultDependencies", Variant("b", False)],
        ["CollectMode", Variant("s", "inactive-or-failed")],
    ]


class SystemdManager:
    """One connection to the system bus, opened at the first call and kept; a call on a
    connection that was lost opens a new one."""

    def __init__(self, connect: Callable[[], Awaitable[Bus]] = connect_system_bus) -> None:
        self._connect = connect
        self._bus: Bus | None = None
        self._lock = asyncio.Lock()
        # Jobs being waited for, by their object path: each ends with JobRemoved.
        self._jobs: dict[str, asyncio.Future[str]] = {}
        # JobRemoved signals that came before the reply that names their job.
        self._ended: dict[str, str] = {}

    async def start_scope(self, unit: str, slice_name: str, pid: int, description: str) -> None:
        """Move `pid` into a new transient scope `unit` in `slice_name`, and wait for
        systemd to have done it."""
        result = await self._run_job(
            "StartTransientUnit",
            "ssa(sv)a(sa(sv))",
            [unit, "fail", scope_properties(slice_name, pid, description), []],
        )
        if result != "done":
            raise Internal(f"systemd could not start {unit} in {slice_name}: job {result}")

    async def stop_unit(self, unit: str) -> bool:
        """Stop a unit; False when systemd has no such unit (already gone)."""
        try:
            await self._run_job("StopUnit", "ss", [unit, "replace"])
        except _NoSuchUnit:
            return False
        return True

    async def close(self) -> None:
        if self._bus is not None:
            self._bus.disconnect()
            self._bus = None

    async def _run_job(self, member: str, signature: str, body: list[Any]) -> str:
        from dbus_fast import Message, MessageType

        bus = await self._connected()
        reply = await bus.call(
            Message(
                destination=DESTINATION,
                path=PATH,
                interface=MANAGER,
                member=member,
                signature=signature,
                body=body,
            )
        )
        if reply.message_type == MessageType.ERROR:
            if reply.error_name == NO_SUCH_UNIT:
                raise _NoSuchUnit(body[0])
            detail = reply.body[0] if reply.body else ""
            raise Internal(f"systemd refused {member} of {body[0]}: {reply.error_name}: {detail}")
        job = str(reply.body[0])
        if job in self._ended:
            return self._ended.pop(job)
        waiter = asyncio.get_running_loop().create_future()
        self._jobs[job] = waiter
        try:
            return await asyncio.wait_for(waiter, JOB_TIMEOUT)
        except TimeoutError:
            raise Internal(
                f"systemd's job for {member} of {body[0]} took over {JOB_TIMEOUT:g}s"
            ) from None
        finally:
            self._jobs.pop(job, None)

    async def _connected(self) -> Bus:
        async with self._lock:
            if self._bus is not None and self._bus.connected:
                return self._bus
            from dbus_fast import Message

            try:
                bus = await self._connect()
            except Exception as err:  # dbus-fast's own errors and the socket's
                # No system bus (dbus not running): say so, not a stack trace.
                raise Internal(f"cannot reach systemd on the system bus: {err}") from None
            bus.add_message_handler(self._on_message)
            # JobRemoved is sent to subscribers only, and through the bus to a match.
            await bus.call(
                Message(
                    destination="org.freedesktop.DBus",
                    path="/org/freedesktop/DBus",
                    interface="org.freedesktop.DBus",
                    member="AddMatch",
                    signature="s",
                    body=[f"type='signal',interface='{MANAGER}',member='JobRemoved'"],
                )
            )
            await bus.call(
                Message(destination=DESTINATION, path=PATH, interface=MANAGER, member="Subscribe")
            )
            self._bus = bus
            return bus

    def _on_message(self, message: Any) -> None:
        if message.member != "JobRemoved" or message.interface != MANAGER:
            return
        _id, job, _unit, result = message.body
        waiter = self._jobs.get(job)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)
        else:
            self._ended[job] = result
            while len(self._ended) > 256:  # others' jobs: keep only the latest
                self._ended.pop(next(iter(self._ended)))


class _NoSuchUnit(Exception):
    pass
