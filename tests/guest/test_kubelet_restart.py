"""`systemctl restart cri-shim` under a real kubelet with churning static pods, counted in
kubelet's own log: with socket activation (scripts/install's default) kubelet logs no
failed CRI call as unavailable; with `--no-socket-activation` it does, which shows that
the count sees them.

The daemon runs as installed (its unit, the installed config: systemd's cgroup driver on
this host, which kubelet follows); kubelet (tests/kubelet.py) runs a steady pod and
churns others, a manifest written and an older one removed as each new pod runs, while
the unit is restarted RESTARTS times. kubelet's pods run again after each restart: the
steady pod's container never restarted, and new pods were made after the last one.

What the count found before the daemon did its part (transport/http2_drain.py): 148-224
lines "error reading server preface" with socket activation. kubelet's gRPC client gives a
new connection 5 s to answer its HTTP/2 preface; the connections it made at the stopping
daemon's GOAWAY waited in the socket's backlog through the stop and the next daemon's
start (8 s under emulation, mostly loading its modules), were closed, and the calls
waiting on them failed UNAVAILABLE. Now the daemon accepts, and answers the preface, from
its first moments (cli.py) to its last, says GOAWAY only then, and a restart costs
kubelet's calls a wait, not an error.

Runs in the guest only (see tests/guest/test_unit.py), as the lane's `kubelet-restart`
step: it takes several minutes under emulation, so it is marked slow and left out of the
`unit` step (`scripts/guest --lane kubelet-restart leftovers`). Each case prints what it
counted, pattern by pattern, with the first lines matched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from cri_shim.api.v1 import api_pb2_grpc
from tests.guest.test_socket_activation import install, systemctl, unit_journal
from tests.guest.test_unit import CONFIG, SOCKET
from tests.guest.test_unit import pytestmark as guest_only
from tests.harness import BUSYBOX_IMAGE, REPO, import_command
from tests.imagebuild import cached_oci_layout
from tests.kubelet import (
    KUBELET,
    LOOP,
    Kubelet,
    containers_of,
    remove_all_sandboxes,
    running_and_ready,
)
from tests.waiting import wait_until

pytestmark = [
    *guest_only,
    pytest.mark.slow,
    pytest.mark.skipif(not KUBELET.exists(), reason=f"no kubelet binary at {KUBELET}"),
]
RESTARTS = 3
# Pods churned at a time, besides the steady one: the emulated guest makes a sandbox in
# 10-20 s.
CHURN_WIDTH = 2
# How kubelet 1.32 logs a CRI call that found no runtime: the gRPC status, then the
# transport's cause (the socket refused or missing, the connection lost mid-call), and
# its own verdicts once its runtime-health check or its sync loop saw one fail.
UNAVAILABLE = {
    "code = Unavailable": re.compile(r"code = Unavailable"),
    "connection refused": re.compile(r"connection refused"),
    # (cAdvisor's probes of other runtimes' sockets fail the same way: not counted.)
    "dial unix ...cri-shim.sock": re.compile(r"dial unix /run/cri-shim/cri-shim\.sock: connect"),
    # A connection closed unanswered: kubelet waits 5 s for the server's preface.
    "error reading server preface": re.compile(r"error reading server preface"),
    "transport is closing": re.compile(r"transport is closing"),
    "error reading from server": re.compile(r"error reading from server"),
    "container runtime is down": re.compile(r"container runtime is down"),
    "Container runtime not ready": re.compile(r"Container runtime not ready"),
}


def count_unavailable(log: str) -> tuple[dict[str, list[str]], int]:
    """The lines of `log` each pattern of UNAVAILABLE matches, and how many lines match
    any (a line may match several)."""
    lines = log.splitlines()
    found = {name: [line for line in lines if p.search(line)] for name, p in UNAVAILABLE.items()}
    return found, sum(1 for line in lines if any(p.search(line) for p in UNAVAILABLE.values()))


def report(case: str, found: dict[str, list[str]], total: int) -> None:
    print(f"\n{case}: {total} kubelet log lines report the runtime unavailable", file=sys.stderr)
    for name, lines in found.items():
        print(f"  {name!r}: {len(lines)}", file=sys.stderr)
        for line in lines[:2]:
            print(f"      {line[:400]}", file=sys.stderr)


def restart_timeline(since: str) -> str:
    """The unit's restarts as its journal tells them: each stop, each start, and when the
    new daemon accepted, restored and served (no daemon failed)."""
    journal = unit_journal(since, "short-precise")
    assert "Traceback" not in journal and "Failed with result" not in journal, journal[-4000:]
    marks = ("Stopping", "Started", "stopped", "accepted early", "state restored", "serving CRI")
    return "\n".join(line[:160] for line in journal.splitlines() if any(m in line for m in marks))


def busybox(name: str) -> dict[str, object]:
    """A container that stops at once on SIGTERM, of the imported image (never pulled)."""
    return {
        "name": name,
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", LOOP],
    }


@dataclass
class Churn:
    """Static pods written and removed in turn on a thread of its own: a new pod once
    the last one runs, the oldest removed so that CHURN_WIDTH stay; `running` counts the
    pods seen running."""

    kubelet: Kubelet
    running: int = 0
    failure: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Churn:
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.failure is not None and exc == (None, None, None):
            raise self.failure

    def _run(self) -> None:
        try:
            live: list[str] = []
            index = 0
            while not self._stop.is_set():
                name = f"churn-{index}"
                index += 1
                self.kubelet.write_pod(name, [busybox("main")])
                live.append(name)
                if self._wait_running(name):
                    self.running += 1
                while len(live) > CHURN_WIDTH:
                    self.kubelet.remove_pod(live.pop(0))
        except BaseException as exc:  # the test sees it once the churn stops
            self.failure = exc

    def _wait_running(self, name: str) -> bool:
        while not self._stop.is_set():
            try:
                if running_and_ready(self.kubelet.pods().get(name)):
                    return True
            except httpx.HTTPError:
                pass  # kubelet's read-only port is busy; asked again
            self._stop.wait(1)
        return False

    def after(self, seen: int) -> Callable[[], bool]:
        """A condition: two more pods ran than `seen` (the first may have been made
        before whatever the caller waits after)."""

        def two_more_ran() -> bool:
            if self.failure is not None:
                raise self.failure
            return self.running >= seen + 2

        return two_more_ran


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[Kubelet]:
    """kubelet on the installed unit's socket (the test installs and starts the unit);
    afterwards kubelet, its pods and the unit with its socket are stopped, so that the
    node holds nothing (tests/guest/leftovers.py)."""
    kubelet = Kubelet(
        short_tmp, SOCKET, f"kr{os.getpid()}", sync_frequency="2s", file_check_frequency="1s"
    )
    try:
        yield kubelet
    finally:
        kubelet.stop()
        if subprocess.run(["systemctl", "is-active", "-q", "cri-shim"], check=False).returncode:
            subprocess.run(["systemctl", "start", "cri-shim"], timeout=300, check=False)
        with grpc.insecure_channel(SOCKET) as channel:
            remove_all_sandboxes(api_pb2_grpc.RuntimeServiceStub(channel))
        left = kubelet.cleanup()
        subprocess.run(
            ["systemctl", "stop", "cri-shim", "cri-shim.socket"], timeout=300, check=False
        )
        subprocess.run(["journalctl", "-u", "cri-shim", "--no-pager", "-n", "30"], check=False)
        assert not left, left


def restarts_under_kubelet(kubelet: Kubelet, layout: Path) -> tuple[dict[str, list[str]], int]:
    """Start the installed unit and kubelet on it, restart the unit RESTARTS times while
    kubelet churns pods, check that its pods run again, and count what kubelet logged
    (up to then: not the teardown)."""
    subprocess.run(import_command(CONFIG, layout, BUSYBOX_IMAGE), check=True, cwd=REPO, timeout=300)
    systemctl("start", "cri-shim")  # Type=notify: returns once the daemon answers the socket
    kubelet.start()
    assert kubelet.systemd, "the installed daemon runs systemd's cgroup driver on this host"
    kubelet.write_pod("steady", [busybox("main")])
    wait_until(lambda: running_and_ready(kubelet.pods().get("steady")), timeout=120, interval=1)
    started = time.monotonic()
    since = f"@{int(time.time())}"
    with Churn(kubelet) as churn:
        wait_until(churn.after(0), timeout=240, interval=1)
        for restart in range(RESTARTS):
            seen = churn.running
            systemctl("restart", "cri-shim")  # returns once the new daemon sent READY=1
            print(f"restart {restart + 1}: churned {seen} pods so far", file=sys.stderr)
            wait_until(churn.after(seen), timeout=240, interval=1)
    print(
        f"{RESTARTS} restarts, {churn.running} pods churned in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    print(restart_timeline(since), file=sys.stderr)
    # kubelet's pods run again: every one it is given (the last churned may still have
    # been starting), the steady one without a restart of its container (the daemon's
    # restarts left it running).
    wait_until(
        lambda: all(running_and_ready(kubelet.pods().get(n)) for n in kubelet.manifest_names()),
        timeout=120,
        interval=1,
    )
    steady = kubelet.pods()["steady"]
    assert containers_of(steady)["main"]["restartCount"] == 0, steady["status"]
    return count_unavailable(kubelet.log(tail=None))


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_oci_layout(tmp_path_factory.mktemp("images"))


def test_kubelet_sees_no_unavailable_runtime_across_restarts_with_socket_activation(
    kubelet: Kubelet, layout: Path
) -> None:
    install()
    found, total = restarts_under_kubelet(kubelet, layout)
    report("socket activation", found, total)
    assert total == 0, {name: lines[:3] for name, lines in found.items() if lines}


def test_kubelet_sees_the_restarts_without_socket_activation(
    kubelet: Kubelet, layout: Path
) -> None:
    install("--no-socket-activation")
    assert not Path("/etc/systemd/system/cri-shim.socket").exists()
    found, total = restarts_under_kubelet(kubelet, layout)
    report("no socket activation", found, total)
    assert total > 0, "kubelet logged no unavailable runtime: the count would see none"
