"""`systemctl restart cri-shim` under churn, with the units scripts/install writes: with
socket activation (the default: cri-shim.socket holds the CRI socket) no call fails;
with `--no-socket-activation` the calls made while the daemon restarts fail UNAVAILABLE.
A stop, unlike a restart, takes the socket down with the daemon (marked slow: run by the
lane's `kubelet-restart` step, not by `unit`).

Runs in the guest only (see tests/guest/test_unit.py); prints the status codes counted
in each case (`scripts/guest -- .venv/bin/pytest -s tests/guest/test_socket_activation.py`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.daemon import DRAIN_TIMEOUT
from tests.call_loop import LoopingClient
from tests.guest.test_unit import pytestmark as guest_only
from tests.harness import REPO

pytestmark = guest_only
SOCKET = Path("/run/cri-shim/cri-shim.sock")
RESTARTS = 3


def systemctl(*args: str) -> None:
    subprocess.run(["systemctl", *args], check=True, timeout=300)


def install(*args: str) -> None:
    subprocess.run(
        [str(REPO / "scripts" / "install"), "--venv", str(REPO / ".venv"), *args],
        check=True,
        timeout=120,
    )


def unit_journal(since: str, output: str = "cat") -> str:
    """The daemon unit's journal since `since` (journalctl's form), in `output`'s form."""
    return subprocess.run(
        ["journalctl", "-u", "cri-shim", "-o", output, "--no-pager", "--since", since],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture
def units() -> Iterator[None]:
    yield
    subprocess.run(["systemctl", "stop", "cri-shim", "cri-shim.socket"], timeout=300, check=False)
    subprocess.run(["journalctl", "-u", "cri-shim", "--no-pager", "-n", "30"], check=False)


def restarts_under_churn() -> Counter[str]:
    """The codes a churning client got over RESTARTS restarts of the unit, and then a
    stop; every daemon stopped cleanly."""
    since = f"@{int(time.time())}"
    with LoopingClient(SOCKET, pods=True) as clients:
        clients.wait_for_calls(20)
        for _ in range(RESTARTS):
            systemctl("restart", "cri-shim")  # returns once the new daemon sent READY=1
            clients.wait_for_calls(clients.codes["OK"] + 20)
    systemctl("stop", "cri-shim")
    journal = unit_journal(since)
    assert "Traceback" not in journal and "Failed with result" not in journal, journal[-4000:]
    return clients.codes


def test_restarts_lose_no_call_with_socket_activation(units: None) -> None:
    install()
    systemctl("start", "cri-shim")  # and cri-shim.socket, which it requires
    codes = restarts_under_churn()
    print(f"socket activation, {RESTARTS} restarts: {dict(codes)}", file=sys.stderr)
    assert set(codes) == {"OK"}, codes


def test_restarts_are_seen_without_socket_activation(units: None) -> None:
    install("--no-socket-activation")
    assert not Path("/etc/systemd/system/cri-shim.socket").exists()
    systemctl("start", "cri-shim")
    codes = restarts_under_churn()
    print(f"no socket activation, {RESTARTS} restarts: {dict(codes)}", file=sys.stderr)
    assert codes["UNAVAILABLE"] > 0, codes


def unit_property(unit: str, name: str) -> str:
    return subprocess.run(
        ["systemctl", "show", f"--property={name}", "--value", unit],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


def refused() -> bool:
    """Whether a connection to the CRI socket is refused (nothing listens on it)."""
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(SOCKET))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
    return False


def active(unit: str) -> bool:
    return unit_property(unit, "ActiveState") == "active"


@pytest.mark.slow
def test_a_stop_takes_the_socket_down_and_a_restart_keeps_it(units: None) -> None:
    """`systemctl stop cri-shim` (StopUnit in mode "replace", which is also how Kubernetes'
    node e2e suite stops a runtime) stops the socket with the daemon: a connection is
    refused and starts nothing, as when a runtime that binds its own socket is stopped.
    A restart keeps the socket systemd listens on (the same invocation of its unit), a
    start brings both back, and a daemon killed without a stop comes back with its socket
    on its own (Restart=on-failure)."""
    install()
    systemctl("start", "cri-shim")
    listening = unit_property("cri-shim.socket", "InvocationID")
    systemctl("restart", "cri-shim")
    assert active("cri-shim.service") and active("cri-shim.socket")
    assert unit_property("cri-shim.socket", "InvocationID") == listening

    systemctl("stop", "cri-shim")
    assert not active("cri-shim.socket")
    assert refused()
    time.sleep(2)  # a connection that reached the socket would have started the daemon
    assert unit_property("cri-shim.service", "ActiveState") == "inactive"

    systemctl("start", "cri-shim")
    assert active("cri-shim.socket") and not refused()

    subprocess.run(
        ["systemctl", "kill", "--kill-whom=main", "--signal=KILL", "cri-shim"],
        check=True,
        timeout=60,
    )
    deadline = time.monotonic() + 120  # RestartSec=5, then a start under emulation
    while not (active("cri-shim.service") and active("cri-shim.socket")):
        assert time.monotonic() < deadline, "the killed daemon did not come back with its socket"
        time.sleep(1)
    assert not refused()


@contextmanager
def silent_registry() -> Iterator[str]:
    """A registry that takes connections and never answers: a pull from it waits."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.slow
def test_a_stop_leaves_a_call_in_flight_only_its_grace(units: None) -> None:
    """A pull from a registry that never answers would hold a restart up to
    DRAIN_TIMEOUT (the next daemon takes the calls held meanwhile); a stop, which takes
    the socket with it, gives it gRPC's 5 s only, as a daemon binding its own socket does
    (Kubernetes' node e2e suite, v1.28.4, waits 10 s for the stop job's end)."""
    install()
    started = time.monotonic()
    systemctl("start", "cri-shim")  # the start job: until the daemon's READY=1 (early)
    print(f"the start took {time.monotonic() - started:.1f} s", file=sys.stderr)
    since = f"@{int(time.time())}"
    with silent_registry() as registry, ThreadPoolExecutor(1) as pool:
        channel = grpc.insecure_channel(f"unix://{SOCKET}")
        image = api_pb2.ImageSpec(image=f"{registry}/held:1")
        pull = pool.submit(
            api_pb2_grpc.ImageServiceStub(channel).PullImage,
            api_pb2.PullImageRequest(image=image),
            timeout=120,
        )
        deadline = time.monotonic() + 60
        while f"PullImage {registry}/held:1" not in unit_journal(since):
            assert time.monotonic() < deadline, "the pull did not reach the daemon"
            time.sleep(1)
        started = time.monotonic()
        systemctl("stop", "cri-shim")  # the stop job: until the daemon has exited
        took = time.monotonic() - started
        error = pull.exception(timeout=60)
        channel.close()
    print(f"a stop with a pull in flight took {took:.1f} s", file=sys.stderr)
    assert isinstance(error, grpc.RpcError), error
    assert took < DRAIN_TIMEOUT, took
