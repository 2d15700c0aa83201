"""The D-Bus calls to systemd's manager, against fakes of the bus (tests/fake_systemd.py)
that answer as systemd does: a job path, then JobRemoved with the job's result;
NoSuchUnit for a unit it does not know; its version. On a socket too, for what only a
socket shows: unix fds passed, and buses that accept and never answer (each call fails
within its bound, UNAVAILABLE, and the next one connects again). The real bus is
exercised in the guest (tests/integration/test_cri_cgroup_driver.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType

from cri_shim.errors import Internal, Unavailable
from cri_shim.host.systemd_manager import ProcessGone, SystemdManager, systemd_version
from cri_shim.runtime.conmon_scope import ConmonScopes, conmon_slice, conmon_unit
from cri_shim.runtime.monitors import ProcessRef, process_stat
from tests.fake_systemd import (
    AUTH,
    EVERYTHING,
    NOTHING,
    SETUP,
    FakeBusSocket,
    FakeSystemdBus,
    manager_on,
)
from tests.waiting import until

# The bounds the silent buses are given, and how long a test waits for the failure: a
# call still waiting then is one without a bound (on the unfixed code, for ever).
BOUND = 0.3
HANG = 20.0


@pytest.fixture
def sleeper() -> Iterator[ProcessRef]:
    """A process to place, as conmon is: by pid and start time."""
    proc = subprocess.Popen(["sleep", "60"])
    stat = process_stat(proc.pid)
    assert stat is not None
    yield ProcessRef(proc.pid, stat[2])
    proc.kill()
    proc.wait()


@pytest.fixture
async def silent_bus(
    short_tmp: Path, request: pytest.FixtureRequest
) -> AsyncIterator[FakeBusSocket]:
    bus = FakeBusSocket(short_tmp / "bus", request.param)
    yield bus
    bus.close()


async def test_a_conmon_scope_is_started_in_the_slice_with_its_pid(sleeper: ProcessRef) -> None:
    bus = FakeSystemdBus(version="252.39-1~deb12u1")
    scopes = ConmonScopes(manager_on(bus), "system.slice")
    await scopes.place("c1", "kubepods-pod1.slice:cri-shim:c1", sleeper)
    subscribed = [m.member for m in bus.calls]
    assert subscribed == ["AddMatch", "Subscribe", "Get", "StartTransientUnit"]
    start = bus.calls[-1]
    assert start.signature == "ssa(sv)a(sa(sv))"
    assert start.body[0] == "cri-shim-conmon-c1.scope" and start.body[1] == "fail"
    assert bus.units["cri-shim-conmon-c1.scope"] == {
        "Description": "cri-shim conmon of container c1",
        "Slice": "system.slice",
        "PIDs": [sleeper.pid],
        "Delegate": True,
        "DefaultDependencies": False,
        "CollectMode": "inactive-or-failed",
    }


async def test_the_job_queued_for_a_unit_is_told_by_its_type() -> None:
    bus = FakeSystemdBus()
    bus.queued.update({"a.socket": "stop", "b.socket": ""})
    systemd = manager_on(bus)
    told = [await systemd.queued_job(unit) for unit in ("a.socket", "b.socket", "c.socket")]
    assert told == ["stop", "", ""]  # c.socket: not loaded, no job either


def test_pod_places_conmon_in_the_pods_slice() -> None:
    assert conmon_slice("pod", "kubepods-pod1.slice:cri-shim:c1") == "kubepods-pod1.slice"
    assert conmon_slice("", "kubepods-pod1.slice:cri-shim:c1") == "system.slice"
    assert conmon_slice("x.slice", "kubepods-pod1.slice:cri-shim:c1") == "x.slice"
    assert conmon_unit("c1") == "cri-shim-conmon-c1.scope"


async def test_one_connection_serves_every_call() -> None:
    bus = FakeSystemdBus()
    connections = 0

    async def connect() -> FakeSystemdBus:
        nonlocal connections
        connections += 1
        return bus

    manager = SystemdManager(connect)
    await asyncio.gather(*(start(manager, f"u{i}.scope") for i in range(5)))
    assert connections == 1
    assert len(bus.units) == 5


async def test_a_failed_job_fails_the_placement() -> None:
    bus = FakeSystemdBus(job_result="failed")
    with pytest.raises(Internal, match=r"could not start cri-shim-conmon-c1\.scope in system"):
        await ConmonScopes(manager_on(bus)).place("c1", "system.slice:cri-shim:c1", own_process())


async def test_removal_stops_a_left_container_scope_and_a_gone_one_is_fine() -> None:
    bus = FakeSystemdBus()
    manager = manager_on(bus)
    await start(manager, "cri-shim-c1.scope", "system.slice")
    scopes = ConmonScopes(manager)
    await scopes.remove("c1", "system.slice:cri-shim:c1")
    assert "cri-shim-c1.scope" not in bus.units
    assert bus.calls[-1].member == "StopUnit" and bus.calls[-1].body == [
        "cri-shim-c1.scope",
        "replace",
    ]
    await scopes.remove("c1", "system.slice:cri-shim:c1")  # gone: NoSuchUnit, no error
    before = len(bus.calls)
    await scopes.remove("c2", "/kubepods/cri-shim-c2")  # a cgroupfs container: no call
    assert len(bus.calls) == before


async def test_a_refused_call_names_the_unit_and_systemds_reason() -> None:
    class Refusing(FakeSystemdBus):
        async def call(self, message: Message) -> Message:
            if message.member == "StartTransientUnit":
                message.serial = 99
                return Message.new_error(
                    message, "org.freedesktop.systemd1.UnitExists", "Unit u.scope already exists."
                )
            return await super().call(message)

    with pytest.raises(
        Internal, match=r"systemd refused StartTransientUnit of u\.scope: .*UnitExists"
    ):
        await start(manager_on(Refusing()), "u.scope")


async def test_a_lost_connection_is_opened_again() -> None:
    first, second = FakeSystemdBus(), FakeSystemdBus()
    buses = iter([first, second])

    async def connect() -> FakeSystemdBus:
        return next(buses)

    manager = SystemdManager(connect)
    await start(manager, "a.scope")
    first.connected = False
    await start(manager, "b.scope")
    assert "b.scope" in second.units
    assert MessageType.METHOD_CALL == second.calls[-1].message_type


async def test_no_system_bus_is_named_and_a_removal_goes_on_without_it() -> None:
    async def connect() -> FakeSystemdBus:
        raise FileNotFoundError(2, "No such file or directory", "/run/dbus/system_bus_socket")

    scopes = ConmonScopes(SystemdManager(connect))
    with pytest.raises(Unavailable, match=r"^cannot reach systemd on the system bus: "):
        await scopes.place("c1", "system.slice:cri-shim:c1", own_process())
    await scopes.remove("c1", "system.slice:cri-shim:c1")  # logged: the container is gone


def own_process() -> ProcessRef:
    stat = process_stat(os.getpid())
    assert stat is not None
    return ProcessRef(os.getpid(), stat[2])


async def start(manager: SystemdManager, unit: str, slice_name: str = "s.slice") -> None:
    """A scope for this test's own process (the fakes move nothing)."""
    pidfd = os.pidfd_open(os.getpid())
    try:
        await manager.start_scope(unit, slice_name, os.getpid(), pidfd, "")
    finally:
        os.close(pidfd)


def test_the_version_is_read_from_what_systemd_says() -> None:
    assert systemd_version("252.39-1~deb12u1") == 252
    assert systemd_version("v256") == 256
    assert systemd_version("255.4-1ubuntu8.4") == 255
    assert systemd_version("unknown") == 0


@pytest.mark.parametrize("silent_bus", [NOTHING, AUTH], indirect=True)
async def test_a_bus_that_never_answers_fails_the_connect_within_its_bound(
    silent_bus: FakeBusSocket,
) -> None:
    manager = silent_bus.manager(connect_timeout=BOUND)
    for call in (start(manager, "u.scope"), manager.stop_unit("u.scope")):
        with pytest.raises(
            Unavailable, match=r"^systemd did not answer on the system bus within 0\.3s"
        ):
            await asyncio.wait_for(call, HANG)
    if silent_bus.answers == NOTHING:
        # Never accepted (dbus.socket with its broker gone): both waited in the backlog,
        # the second a new connection, the first closed by the manager.
        assert silent_bus.backlog() == [True, True]
    else:
        assert silent_bus.accepted == 2
        await until(lambda: silent_bus.closed_by_client == 2)


@pytest.mark.parametrize("silent_bus", [NOTHING], indirect=True)
async def test_calls_queued_behind_a_failed_connect_fail_with_it(
    silent_bus: FakeBusSocket,
) -> None:
    # Removals queue on the connection's lock: they share the attempt's failure rather
    # than each waiting a bound of its own after it.
    manager = silent_bus.manager(connect_timeout=BOUND)
    calls = [manager.stop_unit(f"u{i}.scope") for i in range(5)]
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG)
    assert all(isinstance(r, Unavailable) for r in results), results
    assert silent_bus.backlog() == [True]


@pytest.mark.parametrize("silent_bus", [SETUP], indirect=True)
async def test_a_call_systemd_never_answers_fails_within_its_bound_and_drops_the_connection(
    silent_bus: FakeBusSocket,
) -> None:
    manager = silent_bus.manager(call_timeout=BOUND)
    with pytest.raises(
        Unavailable, match=r"^systemd did not answer StartTransientUnit of u\.scope within 0\.3s"
    ):
        await asyncio.wait_for(start(manager, "u.scope"), HANG)
    with pytest.raises(Unavailable, match=r"^systemd did not answer StopUnit of u\.scope within"):
        await asyncio.wait_for(manager.stop_unit("u.scope"), HANG)
    assert silent_bus.accepted == 2, "the second call opened a connection of its own"
    await until(lambda: silent_bus.closed_by_client == 2)  # each dropped at its timeout


@pytest.mark.parametrize("version", ["253", "252"])
async def test_the_process_goes_to_systemd_as_a_pidfd_where_systemd_takes_one(
    short_tmp: Path, sleeper: ProcessRef, version: str
) -> None:
    # Through a socket, as the system bus passes unix fds.
    bus = FakeBusSocket(short_tmp / "bus", EVERYTHING, version=version)
    try:
        await ConmonScopes(bus.manager(), "system.slice").place(
            "c1", "s.slice:cri-shim:c1", sleeper
        )
        scope = bus.units["cri-shim-conmon-c1.scope"]
        if version == "253":
            assert scope["PIDFDs"] == [sleeper.pid] and "PIDs" not in scope
        else:
            assert scope["PIDs"] == [sleeper.pid] and "PIDFDs" not in scope
    finally:
        bus.close()


@pytest.mark.parametrize("version", ["253", "252"])
async def test_a_pid_reused_by_another_process_is_never_placed(
    sleeper: ProcessRef, version: str
) -> None:
    bus = FakeSystemdBus(version=version)
    scopes = ConmonScopes(manager_on(bus))
    # The pid now names a process started after the conmon recorded with it.
    reused = ProcessRef(sleeper.pid, sleeper.start_time - 1)
    with pytest.raises(ProcessGone, match=r"^conmon \(\d+\) of container c1 exited before"):
        await scopes.place("c1", "s.slice:cri-shim:c1", reused)
    assert "StartTransientUnit" not in [m.member for m in bus.calls]
    assert bus.units == {}


async def test_a_process_that_exits_before_the_call_is_not_placed_by_pid() -> None:
    # Its pid could be anyone's by the time systemd reads it.
    bus = FakeSystemdBus(version="252")
    manager = manager_on(bus)
    proc = await asyncio.create_subprocess_exec("sleep", "60")
    pidfd = os.pidfd_open(proc.pid)  # while it surely runs, then it exits
    try:
        proc.kill()
        await proc.wait()
        with pytest.raises(ProcessGone, match=rf"^process {proc.pid} exited before systemd"):
            await manager.start_scope("u.scope", "s.slice", proc.pid, pidfd, "")
    finally:
        os.close(pidfd)
    assert "StartTransientUnit" not in [m.member for m in bus.calls]
