"""Socket activation: the real daemon given the CRI socket as systemd's cri-shim.socket
gives it (tests/harness.py `pass_fds`), the test holding the socket as systemd does."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from tests.call_loop import LoopingClient
from tests.harness import Daemon, pod_config, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def held_socket(short_tmp: Path) -> Iterator[socket.socket]:
    """The CRI socket bound and listening, as systemd holds it for the service."""
    (short_tmp / "run").mkdir(mode=0o755)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(short_tmp / "run" / "cri-shim.sock"))
    listening.listen(socket.SOMAXCONN)
    yield listening
    listening.close()


@pytest.fixture
def activated(make_daemon, held_socket: socket.socket) -> Daemon:  # type: ignore[no-untyped-def]
    daemon: Daemon = make_daemon(pass_fds=(held_socket.fileno(),))
    daemon.start()
    return daemon


def test_calls_are_served_through_the_activated_socket(activated: Daemon) -> None:
    runtime = activated.runtime()
    assert runtime.Version(api_pb2.VersionRequest(), timeout=10).runtime_name == "cri-shim"
    pod = runtime.RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=pod_config(name="activated")), timeout=60
    ).pod_sandbox_id
    listed = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10).items
    assert [item.id for item in listed] == [pod]
    assert "socket activation" in activated.log()
    # The gRPC server itself listens on a socket only the daemon reaches.
    privates = list(activated.socket.parent.glob(".grpc-*"))
    assert len(privates) == 1 and privates[0].stat().st_mode & 0o077 == 0
    runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=60)
    runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=60)


def test_a_restart_loses_no_call(activated: Daemon) -> None:
    """SIGTERM, as `systemctl restart` sends: the calls made while no daemon runs wait
    in the socket's backlog, those on a stopping daemon's connections are answered or
    retried on the next one (transport/http2_drain.py). Without the drain some come back
    CANCELLED; without the held socket, UNAVAILABLE (the test below)."""
    with LoopingClient(activated.socket, pods=True) as clients:
        for _ in range(3):
            clients.wait_for_calls(clients.codes["OK"] + 50)
            activated.stop()
            # Not waiting for the socket: it is there all along, held by the test.
            activated.start(wait=False)
        clients.wait_for_calls(clients.codes["OK"] + 50)
    assert set(clients.codes) == {"OK"}, clients.codes


def test_without_activation_a_restart_is_seen(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """What socket activation removes: the daemon binding its own socket drops it."""
    daemon: Daemon = make_daemon()
    daemon.start()
    with LoopingClient(daemon.socket) as clients:
        clients.wait_for_calls(50)
        daemon.stop()
        wait_until(lambda: clients.codes["UNAVAILABLE"] > 0, timeout=60)
        daemon.start()
        clients.wait_for_calls(clients.codes["OK"] + 50)
    assert clients.codes["UNAVAILABLE"] > 0, clients.codes


def test_a_socket_on_another_path_stops_the_start(make_daemon, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(short_tmp / "other.sock"))
        other.listen()
        daemon: Daemon = make_daemon(pass_fds=(other.fileno(),))
        daemon.start(wait=False)
        assert daemon.proc is not None
        assert daemon.proc.wait(timeout=60) == 2  # a configuration error: not restarted
    assert "other.sock" in daemon.log() and "cri-shim.sock" in daemon.log()


def test_the_socket_group_is_the_socket_units(make_daemon, held_socket: socket.socket) -> None:  # type: ignore[no-untyped-def]
    daemon: Daemon = make_daemon(pass_fds=(held_socket.fileno(),), settings={"socket_group": "0"})
    daemon.start()
    assert "socket_group '0' does not apply to the socket systemd passed" in daemon.log()
