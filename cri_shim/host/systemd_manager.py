"""systemd's manager over D-Bus: transient scopes for the daemon's own processes.

With the systemd cgroup driver, conmon must not stay in cri-shim.service's cgroup (a
unit whose cgroup systemd manages while the runtime writes below it), nor be a process of
a slice systemd knows nothing of: like CRI-O, each conmon is moved into a transient scope
of its own (`cri-shim-conmon-<id>.scope`) in the slice `conmon_cgroup` names. systemd
removes a scope once its last process has exited, so a conmon's scope goes with it; an
explicit stop is there for a scope a failed create leaves (and runc's container scopes).

Nothing here waits without a bound: a bus that accepts and never answers (dbus-broker
gone behind `dbus.socket`, which keeps accepting into its backlog; a wedged PID 1) would
otherwise hold every CreateContainer and every removal for ever. The connection (the
socket, authentication, `Hello`, the subscription, the manager's version) gets
CONNECT_TIMEOUT, each method call CALL_TIMEOUT, each job JOB_TIMEOUT. A call that runs out
of its bound drops the connection (the next call opens a new one) and fails with
`Unavailable` naming systemd: UNAVAILABLE is what the CRI client gets, as for a registry
that does not answer, since it is systemd, not the client's deadline, that failed, and a
retry once systemd answers again succeeds. (DEADLINE_EXCEEDED would tell kubelet its own
deadline passed, and that the work may still finish for a retry to claim: not so here.)

A process is handed to systemd by pidfd (the `PIDFDs` property, systemd 253 and later),
which names that process and no other; older versions take a pid, checked through the
pidfd to be still running right before the call, so that a pid reused in the meantime is
never moved into the scope.

The protocol is dbus-fast's (asyncio), imported on first use only: a daemon with the
cgroupfs driver never loads it (its import costs 1.1 MiB of Python objects, 3.4 MiB of
RSS with its compiled modules, measured with tracemalloc).
"""

from __future__ import annotations

import asyncio
import logging
import re
import select
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cri_shim.errors import Internal, Unavailable

log = logging.getLogger(__name__)

DESTINATION = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT = "org.freedesktop.systemd1.Unit"
JOB = "org.freedesktop.systemd1.Job"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
# The bounds (module docstring). sd-bus gives a call 25 s; systemd answers a call in
# milliseconds unless it is wedged, and a create that waits for it holds kubelet's call.
CONNECT_TIMEOUT = 10.0
CALL_TIMEOUT = 10.0
# How long a job (a scope's start, a unit's stop) may take before the call fails.
JOB_TIMEOUT = 10.0
# The first version of systemd that takes a scope's processes as pidfds (`PIDFDs`).
PIDFDS_SINCE = 253


class Bus(Protocol):
    """What this module uses of dbus_fast.aio.MessageBus (a fake in the tests)."""

    async def call(self, message: Any) -> Any: ...

    def add_message_handler(self, handler: Callable[[Any], Any]) -> None: ...

    def disconnect(self) -> None: ...

    @property
    def connected(self) -> bool: ...


async def connect_system_bus(address: str | None = None) -> Bus:
    """The system bus (DBUS_SYSTEM_BUS_ADDRESS, else its well-known socket), or the bus at
    `address`; with unix fds negotiated, which pidfds need."""
    from dbus_fast import BusType
    from dbus_fast.aio import MessageBus

    bus: Bus = await MessageBus(
        bus_address=address, bus_type=BusType.SYSTEM, negotiate_unix_fd=True
    ).connect()
    return bus


def scope_properties(slice_name: str, description: str, process: list[Any]) -> list[list[Any]]:
    """StartTransientUnit's properties (a(sv)) of a scope holding `process` (its PIDs or
    PIDFDs property) in `slice_name`: no default dependencies (a scope must not wait for,
    or stop with, basic.target), and collected when it ends, even failed, so that no unit
    is left behind."""
    from dbus_fast import Variant

    return [
        ["Description", Variant("s", description)],
        ["Slice", Variant("s", slice_name)],
        process,
        ["Delegate", Variant("b", True)],
        ["DefaultDependencies", Variant("b", False)],
        ["CollectMode", Variant("s", "inactive-or-failed")],
    ]


def systemd_version(value: str) -> int:
    """The major version in the manager's `Version` ("252.39-1~deb12u1", "v256"), 0 if
    it has none."""
    found = re.match(r"v?(\d+)", value)
    return int(found.group(1)) if found else 0


def has_exited(pidfd: int) -> bool:
    """Whether the process behind a pidfd has exited (a pidfd is readable from then on,
    reaped or not): until it has, its pid cannot name another process."""
    readable, _, _ = select.select([pidfd], [], [], 0)
    return bool(readable)


class ProcessGone(Internal):
    """The process to place exited before systemd was asked to."""


class SystemdManager:
    """One connection to the system bus, opened at the first call and kept; a call on a
    connection that was lost, or dropped because systemd did not answer in time, opens a
    new one."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[Bus]] = connect_system_bus,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        call_timeout: float = CALL_TIMEOUT,
        job_timeout: float = JOB_TIMEOUT,
    ) -> None:
        self._connect = connect
        self._connect_timeout = connect_timeout
        self._call_timeout = call_timeout
        self._job_timeout = job_timeout
        self._bus: Bus | None = None
        self._pidfds = False  # whether the connected manager takes PIDFDs
        self._lock = asyncio.Lock()
        # Connection attempts ended, and why the last one failed (None: it did not).
        self._attempts = 0
        self._failure: str | None = None
        # Jobs being waited for, by their object path: each ends with JobRemoved.
        self._jobs: dict[str, asyncio.Future[str]] = {}
        # JobRemoved signals that came before the reply that names their job.
        self._ended: dict[str, str] = {}

    async def start_scope(
        self, unit: str, slice_name: str, pid: int, pidfd: int, description: str
    ) -> None:
        """Move the process `pid` into a new transient scope `unit` in `slice_name`, and
        wait for systemd to have done it. `pidfd` is a pidfd of that very process (its
        caller checked): handed to systemd itself where systemd takes it, else the pid is
        sent only if the pidfd says the process still runs (ProcessGone otherwise)."""
        from dbus_fast import Variant

        bus = await self._connected()
        fds: list[int] = []
        if self._pidfds:
            process = ["PIDFDs", Variant("ah", [0])]  # an index into the message's fds
            fds = [pidfd]
        elif has_exited(pidfd):
            raise ProcessGone(f"process {pid} exited before systemd could place it in {unit}")
        else:
            process = ["PIDs", Variant("au", [pid])]
        result = await self._run_job(
            bus,
            "StartTransientUnit",
            "ssa(sv)a(sa(sv))",
            [unit, "fail", scope_properties(slice_name, description, process), []],
            fds,
        )
        if result != "done":
            raise Internal(f"systemd could not start {unit} in {slice_name}: job {result}")

    async def stop_unit(self, unit: str) -> bool:
        """Stop a unit; False when systemd has no such unit (already gone)."""
        bus = await self._connected()
        try:
            await self._run_job(bus, "StopUnit", "ss", [unit, "replace"])
        except _NoSuchUnit:
            return False
        return True

    async def queued_job(self, unit: str) -> str:
        """The type of the job systemd has queued for `unit` ("stop", "restart", ...): ""
        when it has none, or knows no such unit."""
        bus = await self._connected()
        from dbus_fast import MessageType

        reply = await self._call(bus, "GetUnit", "s", [unit], None)
        if reply.message_type == MessageType.ERROR:
            return ""  # not loaded: no job either
        job_id, job_path = await self._property(bus, str(reply.body[0]), UNIT, "Job")
        if not job_id:
            return ""
        return str(await self._property(bus, str(job_path), JOB, "JobType"))

    async def close(self) -> None:
        if self._bus is not None:
            self._drop(self._bus, "the daemon stopped")

    async def _run_job(
        self, bus: Bus, member: str, signature: str, body: list[Any], fds: list[int] | None = None
    ) -> str:
        from dbus_fast import MessageType

        reply = await self._call(bus, member, signature, body, fds)
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
            return await asyncio.wait_for(waiter, self._job_timeout)
        except TimeoutError:
            raise Unavailable(
                f"systemd's job for {member} of {body[0]} took over {self._job_timeout:g}s"
            ) from None
        finally:
            self._jobs.pop(job, None)

    async def _property(self, bus: Bus, path: str, interface: str, name: str) -> Any:
        """A property of one of systemd's objects (a unit, a job)."""
        from dbus_fast import MessageType

        reply = await self._call(bus, "Get", "ss", [interface, name], None, path, PROPERTIES)
        if reply.message_type == MessageType.ERROR:
            raise Internal(f"systemd refused {name} of {path}: {reply.error_name}")
        return reply.body[0].value

    async def _call(
        self,
        bus: Bus,
        member: str,
        signature: str,
        body: list[Any],
        fds: list[int] | None,
        path: str = PATH,
        interface: str = MANAGER,
    ) -> Any:
        """One call to the manager (or to another of systemd's objects), within
        CALL_TIMEOUT; the connection is dropped when it runs out (a reply that comes later
        would find nobody) or is lost."""
        from dbus_fast import Message

        message = Message(
            destination=DESTINATION,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body,
            unix_fds=fds or [],
        )
        try:
            return await asyncio.wait_for(bus.call(message), self._call_timeout)
        except TimeoutError:
            reason = f"systemd did not answer {member} of {body[0]} within {self._call_timeout:g}s"
        except Exception as err:  # dbus-fast's own errors and the socket's
            reason = f"the system bus was lost during {member} of {body[0]}: {err}"
        self._drop(bus, reason)
        raise Unavailable(f"{reason} (is PID 1 or the D-Bus broker stuck?)")

    async def _connected(self) -> Bus:
        seen = self._attempts
        async with self._lock:
            if self._bus is not None and self._bus.connected:
                return self._bus
            if self._attempts != seen and self._failure is not None:
                # An attempt that ended while this call waited for the lock failed: its
                # answer is this call's too, rather than each waiting call taking a bound
                # more (removals queue here).
                raise Unavailable(self._failure)
            try:
                self._bus, self._pidfds = await self._open()
                self._failure = None
            except Unavailable as err:
                self._failure = str(err)
                raise
            finally:
                self._attempts += 1
            return self._bus

    async def _open(self) -> tuple[Bus, bool]:
        """A new connection, subscribed to job ends, and whether its manager takes pidfds;
        all of it within CONNECT_TIMEOUT."""
        bus: Bus | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                bus = await self._connect()
                bus.add_message_handler(self._on_message)
                await self._subscribe(bus)
                version = await self._version(bus)
        except TimeoutError:
            reason = (
                f"systemd did not answer on the system bus within {self._connect_timeout:g}s "
                "(is PID 1 or the D-Bus broker stuck?)"
            )
        except Exception as err:  # dbus-fast's own errors and the socket's
            # No system bus (dbus not running): say so, not a stack trace.
            reason = f"cannot reach systemd on the system bus: {err}"
        else:
            log.debug("connected to systemd %d on the system bus", version)
            return bus, version >= PIDFDS_SINCE
        if bus is not None:
            bus.disconnect()
        raise Unavailable(reason)

    @staticmethod
    async def _subscribe(bus: Bus) -> None:
        from dbus_fast import Message

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

    @staticmethod
    async def _version(bus: Bus) -> int:
        from dbus_fast import Message, MessageType

        reply = await bus.call(
            Message(
                destination=DESTINATION,
                path=PATH,
                interface=PROPERTIES,
                member="Get",
                signature="ss",
                body=[MANAGER, "Version"],
            )
        )
        if reply.message_type == MessageType.ERROR or not reply.body:
            return 0
        return systemd_version(str(reply.body[0].value))

    def _drop(self, bus: Bus, reason: str) -> None:
        """Close a connection; the jobs waited for on it fail now, since their ends
        would come on it."""
        bus.disconnect()
        if self._bus is not bus:
            return  # dropped already, its jobs with it
        self._bus = None
        for job, waiter in list(self._jobs.items()):
            if not waiter.done():
                waiter.set_exception(
                    Unavailable(f"the connection to systemd was dropped ({reason}) during {job}")
                )

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
