"""The D-Bus calls to systemd's manager, against a fake bus (FakeSystemdBus) that answers
as systemd does: a job path, then JobRemoved with the job's result; NoSuchUnit for a
unit it does not know. The real bus is exercised in the guest
(tests/integration/test_cri_cgroup_driver.py)."""

from __future__ import annotations

import asyncio

import pytest
from dbus_fast import Message, MessageType

from cri_shim.errors import Internal
from cri_shim.host.systemd_manager import SystemdManager
from cri_shim.runtime.conmon_scope import ConmonScopes, conmon_slice, conmon_unit
from tests.fake_systemd import FakeSystemdBus, manager_on


async def test_a_conmon_scope_is_started_in_the_slice_with_its_pid() -> None:
    bus = FakeSystemdBus()
    scopes = ConmonScopes(manager_on(bus), "system.slice")
    await scopes.place("c1", "kubepods-pod1.slice:cri-shim:c1", 4242)
    subscribed = [m.member for m in bus.calls]
    assert subscribed == ["AddMatch", "Subscribe", "StartTransientUnit"]
    start = bus.calls[-1]
    assert start.signature == "ssa(sv)a(sa(sv))"
    assert start.body[0] == "cri-shim-conmon-c1.scope" and start.body[1] == "fail"
    assert bus.units["cri-shim-conmon-c1.scope"] == {
        "Description": "cri-shim conmon of container c1",
        "Slice": "system.slice",
        "PIDs": [4242],
        "Delegate": True,
        "DefaultDependencies": False,
        "CollectMode": "inactive-or-failed",
    }


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
    await asyncio.gather(*(manager.start_scope(f"u{i}.scope", "s.slice", i, "") for i in range(5)))
    assert connections == 1
    assert len(bus.units) == 5


async def test_a_failed_job_fails_the_placement() -> None:
    bus = FakeSystemdBus(job_result="failed")
    with pytest.raises(Internal, match=r"could not start cri-shim-conmon-c1\.scope in system"):
        await ConmonScopes(manager_on(bus)).place("c1", "system.slice:cri-shim:c1", 1)


async def test_removal_stops_a_left_container_scope_and_a_gone_one_is_fine() -> None:
    bus = FakeSystemdBus()
    manager = manager_on(bus)
    await manager.start_scope("cri-shim-c1.scope", "system.slice", 1, "")
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
        await manager_on(Refusing()).start_scope("u.scope", "s.slice", 1, "")


async def test_a_lost_connection_is_opened_again() -> None:
    first, second = FakeSystemdBus(), FakeSystemdBus()
    buses = iter([first, second])

    async def connect() -> FakeSystemdBus:
        return next(buses)

    manager = SystemdManager(connect)
    await manager.start_scope("a.scope", "s.slice", 1, "")
    first.connected = False
    await manager.start_scope("b.scope", "s.slice", 2, "")
    assert "b.scope" in second.units
    assert MessageType.METHOD_CALL == second.calls[-1].message_type


async def test_no_system_bus_is_named_and_a_removal_goes_on_without_it() -> None:
    async def connect() -> FakeSystemdBus:
        raise FileNotFoundError(2, "No such file or directory", "/run/dbus/system_bus_socket")

    scopes = ConmonScopes(SystemdManager(connect))
    with pytest.raises(Internal, match=r"^cannot reach systemd on the system bus: "):
        await scopes.place("c1", "system.slice:cri-shim:c1", 1)
    await scopes.remove("c1", "system.slice:cri-shim:c1")  # logged: the container is gone
