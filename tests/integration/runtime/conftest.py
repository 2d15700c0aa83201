"""Real runc + conmon on a busybox root filesystem built on the spot (no image store).

The test process makes itself a child subreaper for the module's duration, as the daemon
does, so that the conmon monitors it starts are re-parented to it and must be reaped by
the backend (which is part of what these tests check).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from runc_harness import Runtime

from cri_shim.host.process import set_child_subreaper
from cri_shim.runtime.conmon import RuntimeBackend

RUNC = Path("/usr/sbin/runc")
CONMON = Path("/usr/bin/conmon")
BUSYBOX = Path("/bin/busybox")

PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:App:/home/app:/bin/sh\n"
GROUP = "root:x:0:\napp:x:1001:\naudio:x:29:app\n"


@pytest.fixture(scope="module", autouse=True)
def subreaper() -> Iterator[None]:
    set_child_subreaper(True)
    yield
    set_child_subreaper(False)


@pytest.fixture(scope="session")
def busybox_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/bin/busybox and a symlink per applet, plus /etc/passwd and /etc/group."""
    for tool in (RUNC, CONMON, BUSYBOX):
        if not tool.exists():
            pytest.skip(f"{tool} is not installed")
    root = tmp_path_factory.mktemp("busybox") / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        if applet != "busybox" and "/" not in applet:
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    for directory in ("tmp", "proc", "sys", "dev", "home/app"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    return root


@pytest.fixture
async def runtime(short_tmp: Path, busybox_template: Path) -> AsyncIterator[Runtime]:
    backend = RuntimeBackend(
        "runc",
        RUNC,
        short_tmp / "runc-root",
        CONMON,
        short_tmp / "state",
        call_timeout=20,
        create_timeout=30,
    )
    harness = Runtime(backend, short_tmp, busybox_template)
    yield harness
    for leftover in (short_tmp / "state" / "containers").iterdir():
        await backend.delete(leftover.name)
