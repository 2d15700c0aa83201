"""Socket activation: the real daemon given the CRI socket as systemd's cri-shim.socket
gives it (tests/harness.py `pass_fds`), the test holding the socket as systemd does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.transport.http2_drain import DATA, END_STREAM, HEADERS, PREFACE, frame
from tests.call_loop import LoopingClient
from tests.harness import CniTestNetwork, Daemon, pod_config, wait_until

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


@pytest.fixture
def notify_socket(short_tmp: Path) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(short_tmp / "notify.sock"))
        systemd.settimeout(60)
        yield systemd


@pytest.mark.parametrize("activation", [True, False], ids=["activated", "bound"])
def test_ready_is_sent_once_the_socket_is_answered(  # type: ignore[no-untyped-def]
    make_daemon, held_socket: socket.socket, notify_socket: socket.socket, activation: bool
) -> None:
    """Given the socket, the daemon says READY=1 as soon as it answers it, before its
    modules load and its state is restored (systemd's start job, which Kubernetes' node e2e
    suite waits 10 s for, ends then); the calls made meanwhile wait for the restore, and the
    status says "serving" once they are served. Binding its socket itself, the daemon says
    READY=1 only once it serves."""
    daemon: Daemon = make_daemon(
        pass_fds=(held_socket.fileno(),) if activation else (),
        env={"NOTIFY_SOCKET": notify_socket.getsockname()},
    )
    if not activation:
        held_socket.close()  # the daemon binds the path itself
        Path(notify_socket.getsockname()).parent.joinpath("run", "cri-shim.sock").unlink()
    daemon.start(wait=False)
    first = notify_socket.recv(256).decode()
    if activation:
        assert first.startswith("READY=1\nSTATUS=restoring"), first
        with LoopingClient(daemon.socket) as clients:  # made before the restore is done
            assert notify_socket.recv(256) == b"STATUS=serving"
            clients.wait_for_calls(20)
        assert set(clients.codes) == {"OK"}, clients.codes
    else:
        assert first == "READY=1\nSTATUS=serving"
    daemon.wait_serving()


def test_a_stop_while_the_modules_load_is_graceful(  # type: ignore[no-untyped-def]
    make_daemon, held_socket: socket.socket, notify_socket: socket.socket
) -> None:
    """SIGTERM right after READY=1 (`systemctl restart` just after a start): the daemon
    finishes its start and stops as it would when serving, exit status 0, rather than
    dying of the signal with the calls it held unanswered; the next daemon answers them."""
    daemon: Daemon = make_daemon(
        pass_fds=(held_socket.fileno(),), env={"NOTIFY_SOCKET": notify_socket.getsockname()}
    )
    daemon.start(wait=False)
    assert notify_socket.recv(256).startswith(b"READY=1")
    assert daemon.proc is not None
    with ThreadPoolExecutor(1) as pool:
        channel = grpc.insecure_channel(f"unix://{daemon.socket}")
        call = pool.submit(
            api_pb2_grpc.RuntimeServiceStub(channel).Version,
            api_pb2.VersionRequest(),
            timeout=120,
            wait_for_ready=True,
        )
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=120) == 0, daemon.log()
        assert "stopped" in daemon.log()
        daemon.start(wait=False)
        assert call.result().runtime_name == "cri-shim"
        channel.close()
    daemon.wait_serving()


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


CRICTL = Path("/work/shared/conformance/bin/crictl")
CALLS = 1000
END_HEADERS = 0x4


def _field(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal (without indexing, no Huffman coding)."""
    return b"\0" + bytes((len(name),)) + name + bytes((len(value),)) + value


VERSION_CALL = (
    PREFACE
    + frame(0x4, 0)  # SETTINGS, the protocol's defaults
    + frame(
        HEADERS,
        1,
        _field(b":method", b"POST")
        + _field(b":scheme", b"http")
        + _field(b":path", b"/runtime.v1.RuntimeService/Version")
        + _field(b":authority", b"localhost")
        + _field(b"content-type", b"application/grpc")
        + _field(b"te", b"trailers"),
        flags=END_HEADERS,
    )
    + frame(DATA, 1, b"\0\0\0\0\0", flags=END_STREAM)  # an empty VersionRequest
)


def crictl_version(target: Path) -> None:
    subprocess.run(
        [str(CRICTL), "--runtime-endpoint", f"unix://{target}", "version"],
        check=True,
        capture_output=True,
        timeout=60,
    )


def grpc_python_version(target: Path) -> None:
    with grpc.insecure_channel(f"unix://{target}") as channel:  # closed on leaving
        api_pb2_grpc.RuntimeServiceStub(channel).Version(api_pb2.VersionRequest(), timeout=30)


def connect_and_close(target: Path) -> None:
    """A liveness probe's check (`nc -zU`): connect, close, nothing said."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect(str(target))


def half_closing_version(target: Path) -> None:
    """A client that sends its call, ends its side (shutdown) and reads to the end."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(30)
        client.connect(str(target))
        client.sendall(VERSION_CALL)
        client.shutdown(socket.SHUT_WR)
        while client.recv(65536):
            pass


CLIENTS: dict[str, Callable[[Path], None]] = {
    "crictl": crictl_version,
    "grpc-python": grpc_python_version,
    "connect-close": connect_and_close,
    "half-close": half_closing_version,
}


def descriptors(daemon: Daemon) -> int:
    assert daemon.proc is not None
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def rss_kib(daemon: Daemon) -> int:
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def settled(daemon: Daemon, quiet: float = 0.5, timeout: float = 30) -> int:
    """The daemon's open descriptors once the count has not changed for `quiet` s."""
    deadline = time.monotonic() + timeout
    count = descriptors(daemon)
    since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.05)
        now = descriptors(daemon)
        if now != count:
            count, since = now, time.monotonic()
    return count


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_connections_that_end_leave_no_descriptor_open(activated: Daemon, kind: str) -> None:
    """Each client as people run it, CALLS times: the daemon's open descriptors come
    back to what they were (transport/relay.py closes both ends once both directions have
    ended, and connects no gRPC server for a client gone before it said anything)."""
    call = CLIENTS[kind]
    for _ in range(10):  # what a first call of the kind loads
        call(activated.socket)
    before, rss_before = settled(activated), rss_kib(activated)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(call, [activated.socket] * CALLS))
    after, rss_after = settled(activated), rss_kib(activated)
    print(
        f"{kind}: {CALLS} calls, descriptors {before} -> {after}, "
        f"RSS {rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB"
    )
    assert after <= before, f"{after - before} descriptors left open by {CALLS} {kind} calls"


GOAWAY = 0x7
FRAME_SIZE_ERROR = 0x6


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """The (type, payload) of each whole frame in `data`, from a server's first byte."""
    found, at = [], 0
    while len(data) - at >= 9:
        length = int.from_bytes(data[at : at + 3], "big")
        found.append((data[at + 3], data[at + 9 : at + 9 + length]))
        at += 9 + length
    return found


def read_to_end(client: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := client.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # closed with what the client sent unread
    except TimeoutError:
        pass  # left open: what came is the fate
    return received


def test_a_frame_longer_than_the_relay_takes_ends_its_connection(activated: Daemon) -> None:
    """A client announcing a 16 MiB DATA frame (SETTINGS_MAX_FRAME_SIZE is 16 KiB): told
    GOAWAY FRAME_SIZE_ERROR and closed at its header, what follows not held."""
    sent = 4 << 20  # of the 16 MiB announced: enough to see what a relay holding it costs
    before, rss_before = settled(activated), rss_kib(activated)
    clients = []
    for _ in range(8):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        client.connect(str(activated.socket))
        clients.append(client)
        try:
            client.sendall(PREFACE + frame(0x4, 0) + b"\xff\xff\xff" + bytes((DATA, 0, 0, 0, 0, 1)))
            client.sendall(bytes(sent))
        except OSError:
            pass  # closed by the relay at the frame's header
    after, rss_after = settled(activated), rss_kib(activated)
    print(
        f"8 connections announcing 16 MiB frames, {sent >> 20} MiB sent on each: descriptors "
        f"{before} -> {after}, RSS {rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB"
    )
    fates = []
    for client in clients:
        with client:
            fates.append([(kind, payload[4:8]) for kind, payload in frames(read_to_end(client))])
    for fate in fates:
        assert (GOAWAY, FRAME_SIZE_ERROR.to_bytes(4, "big")) in fate, fate
    assert after <= before
    # Calls on other connections are served.
    runtime = activated.runtime()
    assert runtime.Version(api_pb2.VersionRequest(), timeout=10).runtime_name == "cri-shim"


class StalledCall:
    """A Version call whose request never ends: the client sends its headers and then
    nothing (a request iterator that yields nothing until released)."""

    def __init__(self, target: Path) -> None:
        self._release = threading.Event()
        self._channel = grpc.insecure_channel(f"unix://{target}")
        call = self._channel.stream_unary(
            "/runtime.v1.RuntimeService/Version",
            request_serializer=api_pb2.VersionRequest.SerializeToString,
            response_deserializer=api_pb2.VersionResponse.FromString,
        )
        self.future = call.future(self._requests(), timeout=300)

    def _requests(self) -> Iterator[api_pb2.VersionRequest]:
        self._release.wait()
        yield from ()

    def close(self) -> None:
        self._release.set()
        self._channel.close()


def test_a_stop_ends_a_call_whose_request_never_ended(activated: Daemon) -> None:
    """Without it, the stop waited 30 s for the call, holding every new call meanwhile."""
    stalled = StalledCall(activated.socket)
    try:
        time.sleep(1)  # its headers reach the server
        assert not stalled.future.done()
        started = time.monotonic()
        activated.stop(timeout=120)
        took = time.monotonic() - started
        print(f"stop with a call whose request never ended: {took:.1f} s")
        error = stalled.future.exception(timeout=10)
    finally:
        stalled.close()
    assert isinstance(error, grpc.Call), error
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "request was not complete" in error.details()


def test_the_calls_received_whole_are_answered_across_the_stop(
    activated: Daemon, test_network: CniTestNetwork
) -> None:
    """A pod's creation in flight (its network step held) is answered OK; the call whose
    request never ended is answered UNAVAILABLE meanwhile, not at the end of the stop."""
    runtime = activated.runtime()
    with ThreadPoolExecutor(1) as pool:
        with test_network.held():
            request = api_pb2.RunPodSandboxRequest(config=pod_config(name="across-stop"))
            creation = pool.submit(runtime.RunPodSandbox, request, timeout=120)
            wait_until(lambda: test_network.adds() >= 1, timeout=60)
            stalled = StalledCall(activated.socket)
            try:
                time.sleep(1)  # its headers reach the server
                assert activated.proc is not None
                activated.proc.send_signal(signal.SIGTERM)
                error = stalled.future.exception(timeout=20)  # while the creation is held
            finally:
                stalled.close()
            assert not creation.done()
        pod = creation.result(timeout=60).pod_sandbox_id
        assert activated.proc.wait(timeout=60) == 0
    assert isinstance(error, grpc.Call), error
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    activated.start(wait=True)
    runtime = activated.runtime()
    runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=60)
    runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=60)
