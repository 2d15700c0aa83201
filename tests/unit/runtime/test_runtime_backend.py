"""RuntimeBackend over the conmon-stub and fake-oci-runtime test doubles (no root needed).

The doubles keep conmon's and runc's contracts (sync pipe, pid files, exit file, CRI log,
control FIFO; runc's verbs and error output), so these tests cover the backend's own
logic: ordering, idempotency, cleanup on failure, timeouts, restart-safety.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import DeadlineExceeded, FailedPrecondition, Internal, NotFound
from cri_shim.runtime.cgroup_layout import cgroup_layout
from cri_shim.runtime.conmon import RuntimeBackend, remove_cgroups
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.oom_watch import OomWatch
from tests.crilog import Stream, join_partials, read_records
from tests.unit.runtime.conftest import backend_over_doubles
from tests.waiting import until


def spec_for(tmp_path: Path, script: str) -> dict[str, Any]:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir(exist_ok=True)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "args": ["/bin/sh", "-c", script],
            "cwd": "/",
            "env": ["PATH=/usr/bin:/bin", "GREETING=hello"],
        },
        "root": {"path": str(rootfs)},
        "linux": {"cgroupsPath": "/cri-shim/c1"},
    }


async def create(
    backend: RuntimeBackend, tmp_path: Path, script: str, cid: str = "c1", **kwargs: Any
) -> int:
    return await backend.create(
        cid,
        tmp_path / "bundles" / cid,
        spec_for(tmp_path, script),
        tmp_path / "logs" / f"{cid}.log",
        kwargs.get("tty", False),
        kwargs.get("stdin", False),
    )


def lines(path: Path) -> list[tuple[Stream, bytes]]:
    return [(m.stream, m.content) for m in join_partials(read_records(path))]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


async def test_lifecycle_exit_code_and_log(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    pid = await create(stub_backend, tmp_path, 'echo "$GREETING"; echo oops >&2; exit 3')
    assert pid > 0
    assert (tmp_path / "bundles" / "c1" / "config.json").exists()
    assert int((tmp_path / "bundles" / "c1" / "pidfile").read_text()) == pid
    assert await stub_backend.state("c1") == "created"
    assert stub_backend.exit_status("c1") is None
    assert stub_backend.recorded_exits() == set()

    before = time.time_ns()
    await stub_backend.start("c1")
    code, finished = await stub_backend.wait_exit("c1", 10)
    assert code == 3
    assert before <= finished <= time.time_ns()
    assert stub_backend.exit_status("c1") == (3, finished)
    assert stub_backend.recorded_exits() == {"c1"}
    assert await stub_backend.state("c1") == "stopped"
    assert lines(tmp_path / "logs" / "c1.log") == [
        (Stream.STDOUT, b"hello"),
        (Stream.STDERR, b"oops"),
    ]


async def test_create_failure_carries_the_runtime_message_and_leaves_nothing(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    spec = spec_for(tmp_path, "true")
    spec["process"]["args"] = ["no-such-binary"]
    with pytest.raises(Internal, match='exec: "no-such-binary": executable file not found'):
        await stub_backend.create("c1", tmp_path / "b", spec, tmp_path / "c1.log", False, False)
    assert list((tmp_path / "state" / "containers").iterdir()) == []
    assert list((tmp_path / "state" / "exits").iterdir()) == []
    assert list((tmp_path / "runtime-root").iterdir()) == []
    # The id is free again.
    await create(stub_backend, tmp_path, "true")


async def test_create_of_an_existing_id_never_touches_the_live_container(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    pid = await create(stub_backend, tmp_path, "sleep 30")
    await stub_backend.start("c1")
    with pytest.raises(FailedPrecondition, match="already exists"):
        await create(stub_backend, tmp_path, "true")
    assert alive(pid)
    assert await stub_backend.state("c1") == "running"


async def test_create_timeout_kills_the_monitor_and_cleans_up(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    # A "conmon" that never reports: the create budget must end it.
    slow = tmp_path / "slow-conmon"
    monitor = tmp_path / "monitor.pid"
    slow.write_text(f"#!/bin/sh\nsleep 30 &\necho $$ > {monitor}\nexec sleep 30\n")
    slow.chmod(0o755)
    backend = RuntimeBackend(
        "slow",
        stub_backend.runtime_path,
        tmp_path / "r2",
        slow,
        tmp_path / "s2",
        create_timeout=0.5,
    )
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"longer than 0\.5s"):
        await create(backend, tmp_path, "true")
    assert time.monotonic() - started < 10  # not waited on for its 30 s
    assert list((tmp_path / "s2" / "containers").iterdir()) == []
    if monitor.exists():  # it may have been killed before the shell got that far
        assert not alive(int(monitor.read_text()))


async def test_delete_removes_the_cgroups_a_runtime_killed_inside_create_left(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    # runc killed within its create (a create past its budget, a stopping daemon) has
    # made the container's cgroups, cpuset first, but not the state its delete reads.
    await create(stub_backend, tmp_path, "true")
    cgroups = tmp_path / "cgroup"
    for hierarchy in ("cpuset", "memory"):
        (cgroups / hierarchy / "cri-shim" / "c1").mkdir(parents=True)
    (cgroups / "memory" / "cri-shim" / "c1" / "busy").mkdir()  # not empty: stays
    await stub_backend.delete("c1")
    assert not (cgroups / "cpuset" / "cri-shim" / "c1").exists()
    assert (cgroups / "memory" / "cri-shim" / "c1").exists()
    assert (cgroups / "cpuset" / "cri-shim").exists()  # the parent is not the container's


def test_systemd_cgroups_are_left_to_systemd(tmp_path: Path) -> None:
    (tmp_path / "cpu" / "system.slice" / "cri-shim-c.scope").mkdir(parents=True)
    remove_cgroups("system.slice:cri-shim:c", cgroup_layout(tmp_path, v2=False))
    assert (tmp_path / "cpu" / "system.slice" / "cri-shim-c.scope").exists()


async def test_stop_escalates_to_sigkill(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    trapped = tmp_path / "trapped"
    pid = await create(
        stub_backend, tmp_path, f"trap '' TERM; : > {trapped}; while :; do sleep 0.05; done"
    )
    await stub_backend.start("c1")
    await until(trapped.exists)  # the shell has installed its trap
    started = time.monotonic()
    await stub_backend.stop("c1", 0.5, signal.SIGTERM)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 10  # the grace was waited out, the loop was not
    assert stub_backend.exit_status("c1")[0] == 137  # type: ignore[index]
    assert not alive(pid)
    # Idempotent: stopping again, or stopping something unknown, is fine.
    await stub_backend.stop("c1", 5, signal.SIGTERM)
    await stub_backend.stop("never-created", 5, signal.SIGTERM)


async def test_stop_with_a_signal_the_process_honours(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    started = time.monotonic()
    await stub_backend.stop("c1", 60, signal.SIGTERM)
    assert time.monotonic() - started < 10  # the grace was not waited out
    assert stub_backend.exit_status("c1")[0] == 128 + signal.SIGTERM  # type: ignore[index]


async def test_a_container_that_exits_before_its_stop_signal_lands_is_stopped(
    stub_backend: RuntimeBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime finds it running, then answers ESRCH: its process exited meanwhile.
    monkeypatch.setenv("FAKE_OCI_KILL_LATE", "1")
    await create(stub_backend, tmp_path, "sleep 0.3")
    await stub_backend.start("c1")
    await stub_backend.stop("c1", 5, signal.SIGTERM)
    status = stub_backend.exit_status("c1")
    assert status is not None and status[0] == 0


async def test_stop_of_a_created_container(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    pid = await create(stub_backend, tmp_path, "echo never")
    await stub_backend.stop("c1", 0, signal.SIGKILL)
    assert stub_backend.exit_status("c1")[0] == 137  # type: ignore[index]
    assert not alive(pid)
    assert lines(tmp_path / "logs" / "c1.log") == []


async def test_delete_kills_and_removes_everything_and_is_idempotent(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    pid = await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    assert alive(conmon_pid)
    await stub_backend.delete("c1")
    assert not alive(pid)
    assert not alive(conmon_pid)
    assert not (tmp_path / "state" / "containers" / "c1").exists()
    assert not (tmp_path / "state" / "exits" / "c1").exists()
    assert not (tmp_path / "runtime-root" / "c1").exists()
    assert not (tmp_path / "bundles" / "c1" / "ctl").exists()
    await stub_backend.delete("c1")
    assert await stub_backend.state("c1") == "unknown"


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


async def test_a_new_backend_instance_picks_up_where_the_old_left(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    """The daemon restarts: all the backend needs is on disk, and conmon lives on."""
    pid = await create(stub_backend, tmp_path, "sleep 0.3; exit 7")
    await stub_backend.start("c1")
    restarted = RuntimeBackend(
        "stub",
        stub_backend.runtime_path,
        stub_backend.oci.root,
        stub_backend.conmon_path,
        stub_backend.state_dir,
        call_timeout=10,
    )
    assert (await restarted.wait_exit("c1", 10))[0] == 7
    await restarted.delete("c1")
    assert not alive(pid)
    assert not (tmp_path / "state" / "containers" / "c1").exists()


async def test_exec_sync(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    result = await stub_backend.exec_sync(
        "c1", ["/bin/sh", "-c", 'echo "out $X"; echo err >&2; exit 4'], 10, {"X": "42"}
    )
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == (
        b"out 42\n",
        b"err\n",
        4,
        False,
    )


async def test_exec_sync_timeout_returns_promptly_and_kills_the_process(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    marker = tmp_path / "exec.pid"
    started = time.monotonic()
    result = await stub_backend.exec_sync(
        "c1", ["/bin/sh", "-c", f"echo $$ > {marker}; echo partial; sleep 30; echo never"], 0.5
    )
    elapsed = time.monotonic() - started
    assert result.timed_out and result.exit_code == -1
    assert 0.5 <= elapsed < 10  # not waited on for its 30 s
    assert result.stdout == b"partial\n"
    assert b"timed out" in result.stderr
    assert not alive(int(marker.read_text()))


async def test_exec_sync_of_a_missing_binary_is_an_error_not_an_exit_code(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    with pytest.raises(Internal, match="executable file not found"):
        await stub_backend.exec_sync("c1", ["no-such-tool"], 5)


async def test_exec_sync_in_a_stopped_container(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "true")
    await stub_backend.start("c1")
    await stub_backend.wait_exit("c1", 5)
    with pytest.raises(FailedPrecondition, match="stopped"):
        await stub_backend.exec_sync("c1", ["true"], 5)
    with pytest.raises(NotFound):
        await stub_backend.exec_sync("nope", ["true"], 5)


async def test_reopen_log_after_rotation(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(
        stub_backend,
        tmp_path,
        "i=0; while [ $i -lt 200 ]; do echo line $i; i=$((i+1)); sleep 0.02; done",
    )
    await stub_backend.start("c1")
    log = tmp_path / "logs" / "c1.log"
    await until(lambda: log.exists() and lines(log))
    log.rename(tmp_path / "logs" / "c1.log.1")
    await stub_backend.reopen_log("c1")
    assert log.exists()  # returned only once the new file is there
    await until(lambda: lines(log))
    await stub_backend.stop("c1", 0, signal.SIGKILL)
    old = [c for _, c in lines(tmp_path / "logs" / "c1.log.1")]
    new = [c for _, c in lines(log)]
    assert old and new
    numbers = [int(c.split()[1]) for c in old + new]
    assert numbers == list(range(len(numbers)))  # nothing lost, nothing twice


async def test_reopen_log_of_an_exited_container(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "true")
    await stub_backend.start("c1")
    await stub_backend.wait_exit("c1", 5)
    # The monitor closes its control FIFO as it exits, just after the container.
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    await until(lambda: not alive(conmon_pid))
    with pytest.raises(FailedPrecondition, match="not running"):
        await stub_backend.reopen_log("c1")
    with pytest.raises(NotFound):
        await stub_backend.reopen_log("nope")


async def test_update_resources_passes_oci_resources(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    resources = api_pb2.LinuxContainerResources(cpu_shares=256, memory_limit_in_bytes=32 << 20)
    await stub_backend.update_resources("c1", resources)
    recorded = json.loads((tmp_path / "runtime-root" / "c1" / "resources.json").read_text())
    assert recorded == {"cpu": {"shares": 256}, "memory": {"limit": 32 << 20}}


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


async def test_tty_output_is_logged_as_stdout(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(stub_backend, tmp_path, "[ -t 1 ] && echo on-a-tty", tty=True)
    assert (
        json.loads((tmp_path / "bundles" / "c1" / "config.json").read_text())["process"]["terminal"]
        is True
    )
    await stub_backend.start("c1")
    assert (await stub_backend.wait_exit("c1", 5))[0] == 0
    await until(lambda: lines(tmp_path / "logs" / "c1.log"))
    assert lines(tmp_path / "logs" / "c1.log") == [(Stream.STDOUT, b"on-a-tty\r")]


async def test_stdin_is_held_open(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    # With stdin requested, `cat` waits for input instead of seeing EOF at once.
    await create(stub_backend, tmp_path, "exec cat", stdin=True)
    await stub_backend.start("c1")
    with pytest.raises(DeadlineExceeded):
        await stub_backend.wait_exit("c1", 0.3)
    await create(stub_backend, tmp_path, "exec cat", cid="c2", stdin=False)
    await stub_backend.start("c2")
    assert (await stub_backend.wait_exit("c2", 5))[0] == 0


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden"])
async def test_ids_that_could_escape_the_state_dir_are_refused(
    stub_backend: RuntimeBackend, tmp_path: Path, bad: str
) -> None:
    with pytest.raises(FailedPrecondition, match="invalid container id"):
        await create(stub_backend, tmp_path, "true", cid=bad)


async def test_create_writes_the_tty_flag_into_the_bundle_not_into_the_callers_spec(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    spec = spec_for(tmp_path, "exit 0")
    before = json.dumps(spec, sort_keys=True)
    bundle = tmp_path / "bundles" / "c1"
    await stub_backend.create("c1", bundle, spec, tmp_path / "c1.log", True, False)
    assert json.dumps(spec, sort_keys=True) == before
    written = json.loads((bundle / "config.json").read_text())
    assert written["process"]["terminal"] is True
    assert written["process"]["args"] == spec["process"]["args"]
    await stub_backend.delete("c1")
