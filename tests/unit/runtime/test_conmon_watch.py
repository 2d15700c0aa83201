"""conmon's watch (runtime/conmon_watch.py), over the test doubles: a restart picks up the
running containers and watches them again, and a conmon that dies without recording an
exit ends its container.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.conmon_watch import MONITOR_DIED_EXIT_CODE
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.monitors import MonitorWatch
from cri_shim.runtime.oom_watch import OomWatch
from tests.unit.runtime.conftest import alive, backend_over_doubles, create
from tests.waiting import until


def _restarted(backend: RuntimeBackend) -> RuntimeBackend:
    """The backend a restarted daemon makes over the same files."""
    return RuntimeBackend(
        "stub",
        backend.runtime_path,
        backend.oci.root,
        backend.conmon_path,
        backend.state_dir,
        call_timeout=10,
    )


async def test_a_new_backend_instance_picks_up_where_the_old_left(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    """The daemon restarts: all the backend needs is on disk, and conmon lives on."""
    pid = await create(stub_backend, tmp_path, "sleep 0.3; exit 7")
    await stub_backend.start("c1")
    restarted = _restarted(stub_backend)
    assert (await restarted.wait_exit("c1", 10))[0] == 7
    await restarted.delete("c1")
    assert not alive(pid)
    assert not (tmp_path / "state" / "containers" / "c1").exists()


async def test_a_restart_watches_the_running_containers_for_oom_kills_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> None:
    group = tmp_path / "cgroup" / "cri-shim" / "c1"
    group.mkdir(parents=True)
    (group / "memory.events").write_text("oom 0\noom_kill 0\n")
    v2 = dataclasses.replace(host, cgroup_v2=True)
    before, after = OomWatch(), OomWatch()
    async for backend in backend_over_doubles(tmp_path, monkeypatch, v2, oom_watch=before):
        await create(backend, tmp_path, "exec sleep 30")
        await backend.start("c1")
        before.close()  # the daemon stops; the container runs on
        async for restarted in backend_over_doubles(tmp_path, monkeypatch, v2, oom_watch=after):
            await restarted.adopt(await restarted.states())
            assert len(after) == 1
            (group / "memory.events").write_text("oom 1\noom_kill 1\n")
            assert restarted.oom_killed("c1")
    after.close()


def _kill_conmon(tmp_path: Path, cid: str = "c1") -> None:
    conmon_pid = int((tmp_path / "state" / "containers" / cid / "conmon.pid").read_text())
    os.kill(conmon_pid, signal.SIGKILL)


@pytest.fixture
async def watched_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> AsyncIterator[RuntimeBackend]:
    """A backend whose conmons are watched, as the daemon's are."""
    monitors = MonitorWatch()
    async for backend in backend_over_doubles(tmp_path, monkeypatch, host, monitors=monitors):
        yield backend
    await monitors.aclose()


async def test_a_conmon_that_dies_ends_its_container_with_255(
    watched_backend: RuntimeBackend, tmp_path: Path
) -> None:
    pid = await create(watched_backend, tmp_path, "exec sleep 30")
    await watched_backend.start("c1")
    _kill_conmon(tmp_path)
    await until(lambda: watched_backend.exit_status("c1") is not None)
    assert watched_backend.exit_status("c1")[0] == MONITOR_DIED_EXIT_CODE  # type: ignore[index]
    assert watched_backend.monitor_died("c1")
    assert await watched_backend.state("c1") == "stopped"  # out of the runtime
    await until(lambda: not alive(pid))


async def test_a_restart_ends_the_containers_whose_conmon_died_meanwhile(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30", cid="dead")
    await stub_backend.start("dead")
    await create(stub_backend, tmp_path, "exec sleep 30", cid="live")
    await stub_backend.start("live")
    _kill_conmon(tmp_path, "dead")
    await until(lambda: stub_backend.monitor_gone("dead"))
    assert stub_backend.exit_status("dead") is None  # nobody watched it die
    restarted = _restarted(stub_backend)
    assert await restarted.adopt(await restarted.states()) == ["dead"]
    assert restarted.exit_status("dead")[0] == MONITOR_DIED_EXIT_CODE  # type: ignore[index]
    assert restarted.exit_status("live") is None
    # Ended once: a second look finds its exit recorded.
    assert await restarted.adopt(await restarted.states()) == []
