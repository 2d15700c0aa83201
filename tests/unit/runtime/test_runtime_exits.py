"""A container's end as conmon records it (runtime/exits.py), over the test doubles:
waiting for the exit, a monitor gone without one, OOM kills.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from cri_shim.errors import DeadlineExceeded, Internal
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.oom_watch import OomWatch
from tests.unit.runtime.conftest import backend_over_doubles, create


async def test_wait_exit_times_out(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await stub_backend.wait_exit("c1", 0.3)
    assert time.monotonic() - started < 10  # not waited on for its 30 s


async def test_wait_exit_reports_a_monitor_that_vanished(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    os.kill(conmon_pid, signal.SIGKILL)
    with pytest.raises(Internal, match="without recording an exit code"):
        await stub_backend.wait_exit("c1", 5)


@pytest.mark.parametrize(
    ("oom_control", "expected"),
    [
        ("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n", True),
        ("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n", False),
        (None, False),
    ],
)
async def test_oom_killed_reads_the_cgroup(
    stub_backend: RuntimeBackend, tmp_path: Path, oom_control: str | None, expected: bool
) -> None:
    await create(stub_backend, tmp_path, "true")
    if oom_control is not None:
        group = tmp_path / "cgroup" / "memory" / "cri-shim" / "c1"
        group.mkdir(parents=True)
        (group / "memory.oom_control").write_text(oom_control)
    assert stub_backend.oom_killed("c1") is expected


async def test_oom_killed_reads_conmons_marker(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "true")
    assert not stub_backend.oom_killed("c1")
    (tmp_path / "state" / "containers" / "c1" / "persist" / "oom").write_text("")
    assert stub_backend.oom_killed("c1")


async def test_an_oom_kill_seen_on_cgroup_v2_outlives_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> None:
    """Under systemd's driver the container's scope goes with its last process: the kill
    its memory.events counted is still reported, and the watch goes with the container."""
    pod = tmp_path / "cgroup" / "cri-shim"
    (pod / "c1").mkdir(parents=True)
    (pod / "memory.events").write_text("oom 0\noom_kill 0\n")
    (pod / "c1" / "memory.events").write_text("oom 0\noom_kill 0\n")
    oom_watch = OomWatch()
    v2 = dataclasses.replace(host, cgroup_v2=True)
    async for backend in backend_over_doubles(tmp_path, monkeypatch, v2, oom_watch=oom_watch):
        await create(backend, tmp_path, "true")
        assert len(oom_watch) == 1
        (pod / "c1" / "memory.events").write_text("oom 1\noom_kill 1\n")
        (pod / "memory.events").write_text("oom 1\noom_kill 1\n")
        shutil.rmtree(pod / "c1")
        assert backend.oom_killed("c1")
        await backend.delete("c1")
        assert len(oom_watch) == 0
        await create(backend, tmp_path, "true")  # its cgroup is not there: no watch
        assert len(oom_watch) == 0 and not backend.oom_killed("c1")
    oom_watch.close()
