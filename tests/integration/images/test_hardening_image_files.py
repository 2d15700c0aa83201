"""An image's /etc/passwd is the image author's (issue "Hardening, round two"): a huge one,
a few hundred KB in its layer, must neither block the daemon's other RPCs nor fill its
memory when CreateContainer looks a user name up in it; the creation fails naming it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2

from tests.hardening_kit import code_of, container_config, create_request, running_pod
from tests.harness import Daemon, import_image
from tests.hostile_layers import image_of_layers, write_layout, zero_bomb
from tests.imagebuild import base_layer_tar

pytestmark = [pytest.mark.integration, pytest.mark.root]

HUGE = 64 << 20
IMAGE = "docker.io/library/huge-passwd:v1"


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(field)


class Stalls:
    """Version RPCs in a loop beside the test: the longest one is how long the daemon's
    event loop was blocked."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon, self.worst, self._stop = daemon, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.daemon.runtime().Version(api_pb2.VersionRequest(), timeout=120)
            self.worst = max(self.worst, time.monotonic() - started)
            time.sleep(0.01)

    def __enter__(self) -> Stalls:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def huge_passwd_image(daemon: Daemon, short_tmp: Path) -> Iterator[str]:
    # Millions of ordinary lines: the old reader made an object of each (5 GB at 200 MiB).
    layer = zero_bomb(HUGE, "etc/passwd", b"user:x:1:1::/home/user:/bin/sh\n")
    assert len(layer) < 512 << 10
    layout = write_layout(image_of_layers([base_layer_tar(), layer]), short_tmp / "l", IMAGE)
    import_image(daemon, layout, IMAGE)
    yield IMAGE


def test_a_huge_passwd_neither_blocks_the_daemon_nor_fills_its_memory(
    daemon: Daemon, short_tmp: Path, huge_passwd_image: str
) -> None:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    context = api_pb2.LinuxContainerSecurityContext(run_as_username="app")
    config = container_config(
        "lookup",
        "true",
        image=huge_passwd_image,
        linux=api_pb2.LinuxContainerConfig(security_context=context),
    )
    with running_pod(daemon, "passwd", short_tmp / "logs") as pod:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := current RSS
        before = memory_kib(pid, "VmHWM")
        with Stalls(daemon) as stalls:
            time.sleep(0.1)
            code, details = code_of(
                lambda: daemon.runtime().CreateContainer(create_request(pod, config), timeout=60)
            )
        growth = memory_kib(pid, "VmHWM") - before
    print(f"peak RSS growth {growth} KiB, longest Version RPC {stalls.worst:.3f}s")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "/etc/passwd is larger than 1MiB" in details
    assert growth < 32 << 10, growth
    assert stalls.worst < 1.0, stalls.worst
