"""The runtime layer against real runc 1.1 and conmon 2.1 with busybox containers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from runc_harness import Runtime, shell

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, Internal
from cri_shim.runtime.capabilities import ALL_CAPABILITIES, capabilities_from_mask
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.orphans import OrphanReaper
from cri_shim.runtime.spec import ImageConfigView, SandboxContext
from tests.crilog import Stream
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.root]

CRI_LOG_LINE = re.compile(
    rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}([+-]\d\d:\d\d|Z) "
    rb"(stdout|stderr) [PF] .*$"
)


def processes_with(needle: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `needle`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle.encode() in cmdline and state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def process_exists(pid: int) -> bool:
    """Running or zombie: only a reaped process is gone from /proc."""
    return os.path.exists(f"/proc/{pid}")


def capability_mask(names: Iterable[str]) -> int:
    return sum(1 << ALL_CAPABILITIES.index(name) for name in names)


def cap_eff(output: str) -> frozenset[str]:
    line = next(line for line in output.splitlines() if line.startswith("CapEff:"))
    return capabilities_from_mask(int(line.split()[1], 16))


async def test_exit_code_and_cri_log(runtime: Runtime) -> None:
    cid, code = await runtime.run(shell("echo to-out; echo to-err >&2; printf no-newline; exit 7"))
    assert code == 7
    raw = runtime.log_path(cid).read_bytes().splitlines()
    assert raw and all(CRI_LOG_LINE.match(line) for line in raw), raw
    assert runtime.output(cid) == "to-out\nno-newline"
    assert runtime.output(cid, Stream.STDERR) == "to-err"
    status = runtime.backend.exit_status(cid)
    assert status is not None and status[0] == 7
    assert abs(status[1] - time.time_ns()) < 60 * 10**9


async def test_env_and_working_dir(runtime: Runtime) -> None:
    cfg = shell('echo "$FROM_IMAGE $SHARED $FROM_CRI"; pwd', working_dir="/tmp")
    cfg.envs.extend(
        [
            api_pb2.KeyValue(key="SHARED", value=b"cri-wins"),
            api_pb2.KeyValue(key="FROM_CRI", value=b"c"),
        ]
    )
    image = ImageConfigView(env=("FROM_IMAGE=i", "SHARED=image-loses"), working_dir="/home")
    cid, code = await runtime.run(cfg, image=image)
    assert code == 0
    assert runtime.output(cid) == "i cri-wins c\n/tmp"
    cid, _ = await runtime.run(shell("pwd"), image=image)
    assert runtime.output(cid) == "/home"


async def test_user_from_the_images_passwd(runtime: Runtime) -> None:
    cfg = shell("id -u; id -g; id -G")
    cfg.linux.security_context.run_as_username = "app"
    cfg.linux.security_context.supplemental_groups.append(5000)
    cid, code = await runtime.run(cfg)
    assert code == 0
    uid, gid, groups = runtime.output(cid).splitlines()
    assert (uid, gid) == ("1000", "1001")
    assert set(groups.split()) == {"1001", "29", "5000"}


async def test_readonly_rootfs_refuses_writes(runtime: Runtime) -> None:
    cfg = shell("touch /new-file")
    cfg.linux.security_context.readonly_rootfs = True
    cid, code = await runtime.run(cfg)
    assert code != 0
    assert "Read-only file system" in runtime.output(cid, Stream.STDERR)
    cid, code = await runtime.run(shell("touch /new-file"))
    assert code == 0


async def test_capabilities_added_and_dropped(runtime: Runtime) -> None:
    cfg = shell("grep CapEff /proc/self/status")
    cfg.linux.security_context.capabilities.add_capabilities.append("NET_ADMIN")
    cfg.linux.security_context.capabilities.drop_capabilities.append("CHOWN")
    cid, code = await runtime.run(cfg)
    assert code == 0
    caps = cap_eff(runtime.output(cid))
    assert "CAP_NET_ADMIN" in caps and "CAP_CHOWN" not in caps
    assert "CAP_KILL" in caps and "CAP_SYS_ADMIN" not in caps


async def test_privileged_and_all_get_the_bounding_set_and_still_start(runtime: Runtime) -> None:
    """On this host CAP_SYS_RESOURCE is missing from the bounding set: asking runc for it
    would fail with "unable to apply caps"."""
    bounding = HostLimits.probe().capability_bounding_set
    cfg = shell("grep CapEff /proc/self/status")
    cfg.linux.security_context.privileged = True
    cid, code = await runtime.run(cfg, sandbox=SandboxContext(pod_id="p", privileged=True))
    assert code == 0, runtime.output(cid, Stream.STDERR)
    assert cap_eff(runtime.output(cid)) == bounding

    cfg = shell("grep CapEff /proc/self/status")
    cfg.linux.security_context.capabilities.add_capabilities.append("ALL")
    cid, code = await runtime.run(cfg)
    assert code == 0
    assert capability_mask(cap_eff(runtime.output(cid))) == capability_mask(bounding)


async def test_limits_are_clamped_to_the_daemons(runtime: Runtime) -> None:
    """kubelet's -997 for guaranteed pods and the 1Mi NOFILE default would make runc fail
    here ("can't get final child's PID from pipe", "error setting rlimits")."""
    cfg = shell("cat /proc/self/oom_score_adj; ulimit -n")
    cfg.linux.resources.oom_score_adj = -997
    cid, code = await runtime.run(cfg)
    assert code == 0, runtime.output(cid, Stream.STDERR)
    host = HostLimits.probe()
    assert runtime.output(cid).splitlines() == [
        str(host.oom_score_adj),
        str(min(1_048_576, host.nofile_hard)),
    ]


async def test_runtime_default_seccomp_denies_unshare(runtime: Runtime) -> None:
    cfg = shell("unshare -m true")
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.RuntimeDefault
    cid, code = await runtime.run(cfg)
    assert code != 0
    assert "Operation not permitted" in runtime.output(cid, Stream.STDERR)
    cfg = shell("grep Seccomp: /proc/self/status")
    cfg.linux.security_context.seccomp.profile_type = api_pb2.SecurityProfile.Unconfined
    cid, _ = await runtime.run(cfg)
    assert runtime.output(cid).split() == ["Seccomp:", "0"]


async def test_create_failure_carries_runcs_message_and_leaves_nothing(runtime: Runtime) -> None:
    cfg = api_pb2.ContainerConfig(command=["/bin/no-such-binary"])
    cfg.metadata.name = "broken"
    with pytest.raises(Internal, match='exec: "/bin/no-such-binary": stat /bin/no-such-binary'):
        await runtime.create(cfg, cid="broken")
    assert _runc_list(runtime) == []
    assert not (runtime.base / "state" / "containers" / "broken").exists()
    assert processes_with("-c broken") == []


async def test_exec_sync(runtime: Runtime) -> None:
    cid = await runtime.create(shell("exec sleep 1000"))
    await runtime.backend.start(cid)
    result = await runtime.backend.exec_sync(
        cid, ["sh", "-c", 'echo "$X"; id -u >&2; exit 3'], 10, {"X": "exec-env"}
    )
    assert (result.stdout, result.stderr, result.exit_code) == (b"exec-env\n", b"0\n", 3)
    with pytest.raises(Internal, match="executable file not found"):
        await runtime.backend.exec_sync(cid, ["no-such-tool"], 10)


async def test_exec_sync_timeout_returns_promptly_and_leaves_no_process(runtime: Runtime) -> None:
    cid = await runtime.create(shell("exec sleep 1000"))
    await runtime.backend.start(cid)
    started = time.monotonic()
    result = await runtime.backend.exec_sync(cid, ["sleep", "4242"], 1)
    elapsed = time.monotonic() - started
    assert result.timed_out and result.exit_code == -1
    assert 1 <= elapsed < 10  # killed at its timeout, not waited on
    # Not running, and not a zombie of ours either (runc, its parent, reaped it).
    assert processes_with("sleep 4242") == []
    assert "sleep" not in _zombie_children()


async def test_stop_escalates_to_sigkill_for_a_process_that_traps_term(runtime: Runtime) -> None:
    cid = await runtime.create(
        shell("trap 'echo got TERM' TERM; echo trapped; while :; do sleep 0.1; done")
    )
    await runtime.backend.start(cid)
    await until(lambda: "trapped" in runtime.output(cid))  # the trap is installed
    started = time.monotonic()
    await runtime.backend.stop(cid, 1.0, signal.SIGTERM)
    assert 1.0 <= time.monotonic() - started < 10  # the grace was waited out, no more
    assert runtime.backend.exit_status(cid)[0] == 137  # type: ignore[index]
    assert "got TERM" in runtime.output(cid)
    assert await runtime.backend.state(cid) == "stopped"
    await runtime.backend.stop(cid, 1.0, signal.SIGTERM)  # idempotent


async def test_memory_limit_oom_is_reported(runtime: Runtime) -> None:
    cfg = shell("tail /dev/zero")  # one endless line: tail buffers it all
    cfg.linux.resources.memory_limit_in_bytes = 32 << 20
    cid, code = await runtime.run(cfg, timeout=60)
    assert code == 137
    assert runtime.backend.oom_killed(cid)
    cid, code = await runtime.run(shell("true"))
    assert not runtime.backend.oom_killed(cid)


async def test_reopen_log(runtime: Runtime) -> None:
    cid = await runtime.create(shell("i=0; while :; do echo line $i; i=$((i+1)); sleep 0.02; done"))
    await runtime.backend.start(cid)
    log = runtime.log_path(cid)
    await until(lambda: log.exists() and log.read_text())
    rotated = log.with_suffix(".log.1")
    log.rename(rotated)
    await runtime.backend.reopen_log(cid)
    assert log.exists()
    await until(log.read_text)
    await runtime.backend.stop(cid, 0, signal.SIGKILL)
    before = rotated.read_text().splitlines()
    after = log.read_text().splitlines()
    assert before and after
    numbers = [int(line.split()[-1]) for line in before + after]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))


async def test_reopening_a_log_whose_directory_is_gone_leaves_the_container_running(
    runtime: Runtime,
) -> None:
    """Another kubelet's log garbage collection (or a person) removed the pod's log
    directory: kubelet asks to reopen the log it no longer finds. conmon cannot open a
    file there and would exit without recording the container's exit, and the container
    would be killed as unmonitored; the request is refused instead, naming the directory,
    and the container runs on."""
    cid = await runtime.create(shell("exec sleep 1001"))
    await runtime.backend.start(cid)
    log = runtime.log_path(cid)
    await until(log.exists)
    hidden = log.parent.with_name(log.parent.name + ".gone")
    log.parent.rename(hidden)
    try:
        with pytest.raises(FailedPrecondition, match="no longer exists"):
            await runtime.backend.reopen_log(cid)
        await asyncio.sleep(1)  # conmon, had it been asked, would have exited by now
        assert runtime.backend.exit_status(cid) is None
        assert not runtime.backend.monitor_died(cid)
    finally:
        hidden.rename(log.parent)
    await runtime.backend.reopen_log(cid)  # the directory back: reopened as ever
    await runtime.backend.stop(cid, 0, signal.SIGKILL)


async def test_delete_leaves_no_process_no_runc_state_no_conmon(runtime: Runtime) -> None:
    cid = await runtime.create(shell("exec sleep 1001"))
    await runtime.backend.start(cid)
    pid = int((runtime.base / "bundles" / cid / "pidfile").read_text())
    conmon = int((runtime.base / "state" / "containers" / cid / "conmon.pid").read_text())
    assert processes_with(f"-c {cid}") == [conmon]
    cgroup = Path("/sys/fs/cgroup/memory/cri-shim") / cid
    assert cgroup.exists()
    await runtime.backend.delete(cid)
    assert not process_exists(pid)
    assert processes_with(f"-c {cid}") == []
    assert _runc_list(runtime) == []
    assert not cgroup.exists()
    assert not (runtime.base / "state" / "containers" / cid).exists()
    assert not (runtime.base / "state" / "exits" / cid).exists()
    # conmon was re-parented to us (the subreaper) and reaped, not left a zombie.
    assert not process_exists(conmon)
    await runtime.backend.delete(cid)  # idempotent


@pytest.fixture
def netns() -> Iterator[Path]:
    name = f"cs-rt-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield Path("/run/netns") / name
    subprocess.run(["ip", "netns", "delete", name], check=False)


async def test_joins_the_pods_network_namespace(runtime: Runtime, netns: Path) -> None:
    cid, code = await runtime.run(
        shell("ls /sys/class/net; readlink /proc/self/ns/net"),
        sandbox=SandboxContext(pod_id="p", netns_path=netns),
    )
    assert code == 0
    interfaces, ns_link = runtime.output(cid).splitlines()
    assert interfaces == "lo"
    assert ns_link == f"net:[{os.stat(netns).st_ino}]"


def _runc_list(runtime: Runtime) -> list[object]:
    out = subprocess.run(
        ["runc", "--root", str(runtime.backend.oci.root), "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out) or []


def _parent_of(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw.rsplit(b")", 1)[1].split()[1])


def _zombie_children() -> list[str]:
    """Command names of zombies whose parent is this test process."""
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        head, rest = raw.rsplit(b")", 1)
        fields = rest.split()
        if fields[0] == b"Z" and int(fields[1]) == os.getpid():
            names.append(head.split(b"(", 1)[1].decode())
    return names


async def test_stop_of_a_created_container(runtime: Runtime) -> None:
    """StopContainer (or RemoveContainer) on a container that was never started."""
    cid = await runtime.create(shell("echo never runs"))
    assert await runtime.backend.state(cid) == "created"
    await runtime.backend.stop(cid, 0, signal.SIGKILL)
    assert runtime.backend.exit_status(cid)[0] == 137  # type: ignore[index]
    assert runtime.output(cid) == ""
    await runtime.backend.delete(cid)
    assert _runc_list(runtime) == []


async def test_container_outlives_the_process_that_created_it(runtime: Runtime) -> None:
    """The daemon dies after StartContainer: conmon and the container live on, and a new
    backend over the same directories can stop it and read its exit code."""
    spec = runtime.spec("survivor", shell("trap 'exit 42' TERM; while :; do sleep 0.1; done"))
    (runtime.base / "survivor.json").write_text(json.dumps(spec))
    backend = runtime.backend
    script = f"""
import asyncio, json, sys
from pathlib import Path
from cri_shim.runtime.conmon import RuntimeBackend
async def main():
    b = RuntimeBackend("runc", Path("{backend.runtime_path}"), Path("{backend.oci.root}"),
                       Path("{backend.conmon_path}"), Path("{backend.state_dir}"))
    spec = json.loads(Path("{runtime.base / "survivor.json"}").read_text())
    await b.create("survivor", Path("{runtime.base / "bundles" / "survivor"}"), spec,
                   Path("{runtime.log_path("survivor")}"), False, False)
    await b.start("survivor")
asyncio.run(main())
"""
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, cwd=str(Path(__file__).parents[3])
    )
    assert await daemon.wait() == 0
    # The "daemon" is gone; a fresh backend takes over.
    restarted = RuntimeBackend(
        "runc", backend.runtime_path, backend.oci.root, backend.conmon_path, backend.state_dir
    )
    assert await restarted.state("survivor") == "running"
    await restarted.stop("survivor", 5, signal.SIGTERM)
    assert restarted.exit_status("survivor")[0] == 42  # type: ignore[index]
    await restarted.delete("survivor")
    assert processes_with("-c survivor") == []


async def test_an_orphan_on_the_subreaper_does_not_block_delete(runtime: Runtime) -> None:
    """`runc exec` dies before its process: the process is re-parented to us (the
    subreaper). Unreaped, its zombie keeps the container's PID namespace from dying and
    `runc delete` fails with "container init still running"; the reaper prevents it."""
    cid = await runtime.create(shell("exec sleep 1000"))
    await runtime.backend.start(cid)
    pid_file = runtime.base / "exec.pid"
    runc_exec = await asyncio.create_subprocess_exec(
        "runc",
        "--root",
        str(runtime.backend.oci.root),
        "exec",
        "--pid-file",
        str(pid_file),
        cid,
        "sleep",
        "4343",
        start_new_session=True,
    )
    # runc writes the pid file once the process runs.
    await until(lambda: pid_file.exists() and pid_file.read_text())
    orphan = int(pid_file.read_text())
    runc_exec.kill()
    await runc_exec.wait()
    await until(lambda: _parent_of(orphan) == os.getpid())  # re-parented to us, the subreaper
    reaper = asyncio.create_task(OrphanReaper().run(interval=0.1))
    try:
        await runtime.backend.delete(cid)
    finally:
        reaper.cancel()
    assert _runc_list(runtime) == []
    assert "sleep" not in _zombie_children()
