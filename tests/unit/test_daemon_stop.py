"""How long a stopping daemon behind an activated socket lets the calls in flight finish:
a restart's drain (the socket stays, and the next daemon takes what is held), or, when
systemd stops the socket too (`systemctl stop cri-shim`), the grace a daemon that binds
its own socket gives. systemd is a fake of its bus (tests/fake_systemd.py); the real one
is asked in the guest (tests/guest/test_socket_activation.py)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from cri_shim import daemon as daemon_module
from cri_shim.config import Config
from cri_shim.daemon import DRAIN_TIMEOUT, Daemon, socket_stops
from cri_shim.host.systemd_manager import SystemdManager
from tests.fake_systemd import FakeSystemdBus, manager_on

SOCKET_UNIT = "cri-shim.socket"


async def test_a_socket_with_a_stop_queued_stops() -> None:
    bus = FakeSystemdBus()
    bus.queued[SOCKET_UNIT] = "stop"
    assert await socket_stops(SOCKET_UNIT, manager_on(bus))


async def test_a_socket_with_no_job_stays_for_the_next_daemon() -> None:
    bus = FakeSystemdBus()
    bus.queued[SOCKET_UNIT] = ""  # a restart of the service queues nothing for it
    assert not await socket_stops(SOCKET_UNIT, manager_on(bus))


async def test_a_name_that_is_no_unit_is_not_asked_for() -> None:
    bus = FakeSystemdBus()
    assert not await socket_stops("cri", manager_on(bus))  # FileDescriptorName=cri
    assert bus.calls == []


async def test_where_systemd_cannot_be_asked_the_socket_is_taken_to_stay() -> None:
    async def no_bus() -> Any:
        raise ConnectionRefusedError("no system bus")

    assert not await socket_stops(SOCKET_UNIT, SystemdManager(no_bus))


class FakeRelay:
    """A stand-in for the relay (a fake): how long the stop waited for its calls."""

    def __init__(self) -> None:
        self.waited: list[float] = []

    def drain(self) -> None:
        pass

    async def answered(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return True

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize(("queued", "waits"), [("stop", []), ("", [DRAIN_TIMEOUT])])
async def test_only_a_restart_waits_for_the_calls_in_flight_before_grpc_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queued: str, waits: list[float]
) -> None:
    """A stop leaves the calls in flight to gRPC's own STOP_GRACE, as a daemon that binds
    its socket does; a restart lets them finish first, up to DRAIN_TIMEOUT."""
    bus = FakeSystemdBus()
    bus.queued[SOCKET_UNIT] = queued
    monkeypatch.setattr(daemon_module, "SystemdManager", lambda **_: manager_on(bus))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(tmp_path / "cri.sock"))
        listening.listen()
        acceptor = daemon_module.EarlyAcceptor(listening, SOCKET_UNIT)
        acceptor.take()
        daemon = Daemon(Config(), acceptor)
        relay = FakeRelay()
        daemon._relay = relay  # type: ignore[assignment]
        await daemon.stop()
    assert relay.waited == waits
