"""gVisor (`runsc`) as a runtime handler: each pod is one sandbox that its containers join.

The handler is configured by its path alone, plus `--network=host`: the runsc Debian
ships (2022-12) takes every network namespace of Linux 6.11 and newer for the host's and
refuses to start its own network stack there (the pod keeps its own namespace; gVisor
then uses the kernel's network stack in it). The daemon's runsc state root is
`<run_root>/runtime/runsc`, where `runsc list` shows what the daemon made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.cpusets import first_missing, parse
from tests.harness import Daemon, conmon_of, wait_until
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    output,
    pod,
    pod_state,
    run_to_exit,
    start,
    status,
)
from tests.integration.streaming.clients import (
    PORTFORWARD,
    CommandResult,
    SpdyClient,
    SpdyCommand,
    spdy_exec,
    spdy_forward_once,
)

RUNSC = shutil.which("runsc")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.root,
    pytest.mark.skipif(RUNSC is None, reason="runsc (gVisor) is not installed"),
]

HANDLERS = {
    "runc": {"path": "runc"},
    "runsc": {"path": str(RUNSC), "runtime_args": ["--network=host"]},
}


def runsc_list(daemon: Daemon) -> list[dict[str, Any]]:
    listed = subprocess.run(
        [str(RUNSC), "--root", str(daemon.run_root / "runtime" / "runsc"), "list", "-format=json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(listed.stdout) or []


@pytest.fixture
def gvisor(make_daemon: Any, busybox_layout: Path) -> Iterator[Daemon]:
    daemon: Daemon = make_daemon(settings={"runtime": {"handlers": HANDLERS}})
    daemon.start()
    import_image(daemon, busybox_layout)
    yield daemon


def test_a_pod_is_one_sandbox_holding_both_its_containers(gvisor: Daemon, short_tmp: Path) -> None:
    with pod(gvisor, "gv", short_tmp, handler="runsc") as p:
        sandbox_id = p[0]
        first = create(gvisor, p, container_config("first", "exec sleep 60"))
        second = create(gvisor, p, container_config("second", "exec sleep 60"))
        for container_id in (first, second):
            start(gvisor, container_id)
        listed = {c["id"]: c for c in runsc_list(gvisor)}
        assert set(listed) == {sandbox_id, first, second}
        types = {
            cid: c["annotations"]["io.kubernetes.cri.container-type"] for cid, c in listed.items()
        }
        assert types == {sandbox_id: "sandbox", first: "container", second: "container"}
        assert {c["annotations"]["io.kubernetes.cri.sandbox-id"] for c in listed.values()} == {
            sandbox_id
        }
        # One sandbox process: runsc reports its pid for every container in it.
        assert len({c["pid"] for c in listed.values()}) == 1
        assert {c["status"] for c in listed.values()} == {"running"}
        # gVisor's own kernel: the container sees its own process as PID 1, and the pod's
        # address on its interface.
        ps = exec_sync(gvisor, first, ["ps", "-o", "pid,args"])
        assert b"1 sleep 60" in ps.stdout
        assert status(gvisor, first).state == api_pb2.CONTAINER_RUNNING
        # A command past its timeout is killed inside the sandbox, and only it.
        with pytest.raises(grpc.RpcError) as timed_out:
            gvisor.runtime().ExecSync(
                api_pb2.ExecSyncRequest(container_id=first, cmd=["sleep", "77"], timeout=1),
                timeout=60,
            )
        assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ps = exec_sync(gvisor, first, ["ps", "-o", "args"])
        assert b"sleep 77" not in ps.stdout, ps
        assert status(gvisor, first).state == api_pb2.CONTAINER_RUNNING
        assert status(gvisor, second).state == api_pb2.CONTAINER_RUNNING
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_a_pod_whose_sandbox_conmon_dies_is_not_ready(gvisor: Daemon, short_tmp: Path) -> None:
    with pod(gvisor, "orphaned", short_tmp, handler="runsc") as p:
        sandbox_id = p[0]
        container_id = create(gvisor, p, container_config("c", "exec sleep 60"))
        start(gvisor, container_id)
        os.kill(conmon_of(gvisor, sandbox_id), signal.SIGKILL)

        # The sandbox is deleted with its container (nothing runs unmonitored), and the
        # pod is not ready, as when the sandbox itself dies.
        wait_until(lambda: pod_state(gvisor, sandbox_id) == api_pb2.SANDBOX_NOTREADY, timeout=60)
        assert sandbox_id not in {c["id"] for c in runsc_list(gvisor)}
        wait_until(
            lambda: status(gvisor, container_id).state == api_pb2.CONTAINER_EXITED, timeout=60
        )
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_exit_codes_and_logs_come_back_from_the_sandbox(gvisor: Daemon, short_tmp: Path) -> None:
    with pod(gvisor, "exits", short_tmp, handler="runsc") as p:
        done = run_to_exit(gvisor, p, container_config("three", "echo bye; exit 3"))
        assert done.exit_code == 3
        assert Path(done.log_path).read_text().rstrip().endswith("bye")
        # Stopped by the daemon: killed inside the sandbox, reported as runc's would be.
        long = create(gvisor, p, container_config("long", "exec sleep 600"))
        start(gvisor, long)
        gvisor.runtime().StopContainer(
            api_pb2.StopContainerRequest(container_id=long, timeout=0), timeout=60
        )
        stopped = status(gvisor, long)
        assert stopped.state == api_pb2.CONTAINER_EXITED
        assert stopped.exit_code == 137
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_bind_mounts_and_a_stop_before_start(gvisor: Daemon, short_tmp: Path) -> None:
    volume = short_tmp / "volume"
    volume.mkdir()
    (volume / "note").write_text("from the host\n")
    with pod(gvisor, "mounts", short_tmp, handler="runsc") as p:
        # runsc makes a container's mounts when it starts it, not when it creates it.
        mount = api_pb2.Mount(container_path="/data", host_path=str(volume), readonly=True)
        done = run_to_exit(gvisor, p, container_config("reader", "cat /data/note", mounts=[mount]))
        assert done.exit_code == 0
        assert Path(done.log_path).read_text().rstrip().endswith("from the host")
        # runsc cannot signal a container it has only created.
        never = create(gvisor, p, container_config("never", "exec sleep 600"))
        gvisor.runtime().StopContainer(
            api_pb2.StopContainerRequest(container_id=never, timeout=0), timeout=60
        )
        assert status(gvisor, never).state == api_pb2.CONTAINER_EXITED
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_streaming_exec_and_attach_reach_the_container(gvisor: Daemon, short_tmp: Path) -> None:
    with pod(gvisor, "streams", short_tmp, handler="runsc") as p:
        user = api_pb2.LinuxContainerConfig(
            security_context=api_pb2.LinuxContainerSecurityContext(
                run_as_user=api_pb2.Int64Value(value=1001)
            )
        )
        config = container_config("echo", "echo ready; exec cat", stdin=True, stdin_once=True)
        attached = create(gvisor, p, config)
        shell = create(gvisor, p, container_config("shell", "exec sleep 300", linux=user))
        for container_id in (attached, shell):
            start(gvisor, container_id)
        # As the container's user (runsc's exec would run as root), with stdin.
        request = api_pb2.ExecRequest(
            container_id=shell, cmd=["sh", "-c", "id -u; tr a-z A-Z"], stdin=True, stdout=True
        )
        url = gvisor.runtime().Exec(request, timeout=10).url
        result = asyncio.run(spdy_exec(url, stdin=b"through stdin\n"))
        assert result.stdout.decode().splitlines() == ["1001", "THROUGH STDIN"], result
        # With a terminal: runsc's console socket hands one over, sized by the client.
        command = ["sh", "-c", "[ -t 0 ] && echo terminal; read line; stty size; exit 3"]
        request = api_pb2.ExecRequest(
            container_id=shell, cmd=command, tty=True, stdin=True, stdout=True
        )
        url = gvisor.runtime().Exec(request, timeout=10).url
        typed = asyncio.run(_terminal_session(url, b"typed\r"))
        assert typed.stdout.splitlines() == [b"terminal", b"typed", b"30 100"], typed
        assert b"exit status 3" in typed.error, typed
        # A client that leaves: its command is killed inside the sandbox, where no host
        # signal reaches it (killing the host's `runsc exec` alone would leave it running).
        for tty in (True, False):
            request = api_pb2.ExecRequest(
                container_id=shell, cmd=["sleep", "997"], tty=tty, stdout=True
            )
            url = gvisor.runtime().Exec(request, timeout=10).url
            asyncio.run(_leave_while_running(url, gvisor, shell, tty))
            wait_until(lambda: len(runsc_processes(gvisor, shell)) == 1, timeout=30)
        # Attach goes through conmon, whose streams the container got when it started.
        wait_until(lambda: output(status(gvisor, attached)) == ["ready"], timeout=10)
        request = api_pb2.AttachRequest(container_id=attached, stdin=True, stdout=True, stderr=True)
        url = gvisor.runtime().Attach(request, timeout=10).url
        result = asyncio.run(spdy_exec(url, stdin=b"through attach\n"))
        assert result.stdout == b"through attach\n", result
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def runsc_processes(daemon: Daemon, container_id: str) -> list[dict[str, Any]]:
    """The processes of a container in its sandbox (gVisor's kernel), by `runsc ps`."""
    root = daemon.run_root / "runtime" / "runsc"
    listed = subprocess.run(
        [str(RUNSC), "--root", str(root), "ps", "--format=json", container_id],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(listed.stdout) or []


async def _leave_while_running(url: str, daemon: Daemon, container_id: str, tty: bool) -> None:
    command = await SpdyCommand.start(url, stderr=not tty, tty=tty)
    try:
        await asyncio.to_thread(
            wait_until, lambda: len(runsc_processes(daemon, container_id)) == 2, 30
        )
    finally:
        await command.close()


async def _terminal_session(url: str, line: bytes) -> CommandResult:
    """Exec with a terminal: resized to 100x30 before the command reads `line`."""
    command = await SpdyCommand.start(url, stdin=True, stderr=False, tty=True)
    try:
        await command.resize(100, 30)
        await command.wait_for(b"terminal")
        await command.send(line)
        return await command.result()
    finally:
        await command.close()


def test_a_shared_pid_namespace_is_the_sandboxs_own(gvisor: Daemon, short_tmp: Path) -> None:
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=api_pb2.NamespaceOption(pid=api_pb2.POD)
        )
    )
    shared = api_pb2.LinuxContainerConfig(
        security_context=api_pb2.LinuxContainerSecurityContext(
            namespace_options=api_pb2.NamespaceOption(pid=api_pb2.POD)
        )
    )
    with pod(gvisor, "sharedpid", short_tmp, handler="runsc", linux=linux) as p:
        first = create(gvisor, p, container_config("first", "exec sleep 301", linux=shared))
        second = create(gvisor, p, container_config("second", "exec sleep 302", linux=shared))
        for container_id in (first, second):
            start(gvisor, container_id)
        ps = exec_sync(gvisor, second, ["ps", "-o", "pid,args"]).stdout.decode()
        # The sandbox container's pause program is PID 1; both containers are there.
        assert "1 /pause" in ps, ps
        assert "sleep 301" in ps and "sleep 302" in ps, ps
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_a_restart_adopts_the_sandbox_and_its_end_stops_the_pod(
    gvisor: Daemon, short_tmp: Path
) -> None:
    with pod(gvisor, "adopted", short_tmp, handler="runsc") as p:
        sandbox_id = p[0]
        container_id = create(gvisor, p, container_config("c", "exec sleep 300"))
        start(gvisor, container_id)
        gvisor.kill9()
        gvisor.start()
        assert {c["id"] for c in runsc_list(gvisor)} == {sandbox_id, container_id}
        assert status(gvisor, container_id).state == api_pb2.CONTAINER_RUNNING
        assert exec_sync(gvisor, container_id, ["echo", "still"]).stdout == b"still\n"

        assert pod_state(gvisor, sandbox_id) == api_pb2.SANDBOX_READY
        # The sandbox gone (killed from outside): the pod and its container with it.
        (sandbox,) = [c for c in runsc_list(gvisor) if c["id"] == sandbox_id]
        subprocess.run(["kill", "-9", str(sandbox["pid"])], check=True)
        wait_until(lambda: pod_state(gvisor, sandbox_id) == api_pb2.SANDBOX_NOTREADY, timeout=30)
        wait_until(
            lambda: status(gvisor, container_id).state == api_pb2.CONTAINER_EXITED, timeout=30
        )
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_port_forward_reaches_the_pods_loopback_through_its_sandbox(
    gvisor: Daemon, short_tmp: Path
) -> None:
    serve = (
        "mkdir -p /tmp/www && echo hello-from-gvisor > /tmp/www/index.html && "
        "exec httpd -f -p 127.0.0.1:8080 -h /tmp/www"
    )
    with pod(gvisor, "forward", short_tmp, handler="runsc") as p:
        start(gvisor, create(gvisor, p, container_config("web", serve)))
        request = api_pb2.PortForwardRequest(pod_sandbox_id=p[0], port=[8080])

        async def get() -> tuple[bytes, bytes]:
            url = gvisor.runtime().PortForward(request, timeout=10).url  # single use
            client = await SpdyClient.connect(url, [PORTFORWARD])
            try:
                return await spdy_forward_once(client, 8080, 0, b"GET / HTTP/1.0\r\n\r\n")
            finally:
                await client.close()

        received, error = wait_until(lambda: (r := asyncio.run(get()))[0] and r, timeout=20)
        assert b"hello-from-gvisor" in received, (received, error)
        # Through the sandbox (runsc exec of the relay), not a dial from the node's side,
        # which gVisor's own network stack would never answer.
        assert "through its sandbox" in gvisor.log_path.read_text()
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def test_runc_pods_keep_no_process_of_their_own(gvisor: Daemon, short_tmp: Path) -> None:
    with pod(gvisor, "plain", short_tmp, handler="runc") as p:
        container_id = create(gvisor, p, container_config("c", "exec sleep 60"))
        start(gvisor, container_id)
        assert gvisor.runc_containers() == [container_id]
        assert runsc_list(gvisor) == []


def test_what_gvisor_cannot_do_is_refused_naming_the_handler(
    gvisor: Daemon, short_tmp: Path
) -> None:
    response = gvisor.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    features = {h.name: h.features for h in response.runtime_handlers}
    assert not features["runsc"].recursive_read_only_mounts
    assert not features["runsc"].user_namespaces
    for field in ("pid", "ipc", "network"):
        linux = api_pb2.LinuxPodSandboxConfig(
            security_context=api_pb2.LinuxSandboxSecurityContext(
                namespace_options=api_pb2.NamespaceOption(**{field: api_pb2.NODE})
            )
        )
        with pytest.raises(grpc.RpcError) as refused:
            with pod(gvisor, f"host{field}", short_tmp, handler="runsc", linux=linux):
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"namespace_options.{field}" in str(refused.value.details())
        assert "'runsc'" in str(refused.value.details())
    with pod(gvisor, "limits", short_tmp, handler="runsc") as p:
        privileged = container_config(
            "priv",
            "exec sleep 60",
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(privileged=True)
            ),
        )
        with pytest.raises(grpc.RpcError) as refused:
            create(gvisor, p, privileged)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'runsc'" in str(refused.value.details())
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


MiB = 1 << 20
CGROUPS = Path("/sys/fs/cgroup")


def cgroup_value(cgroups_path: str, controller: str, name: str) -> str:
    return (CGROUPS / controller / cgroups_path.strip("/") / name).read_text().strip()


def cgroups_path_of(daemon: Daemon, container_id: str) -> str:
    spec = json.loads(status_info(daemon, container_id))["runtimeSpec"]
    return str(spec["linux"]["cgroupsPath"])


def status_info(daemon: Daemon, container_id: str) -> str:
    response = daemon.runtime().ContainerStatus(
        api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=10
    )
    return response.info["info"]


def limits(memory: int, shares: int, quota: int, cpus: str = "") -> api_pb2.LinuxContainerResources:
    return api_pb2.LinuxContainerResources(
        memory_limit_in_bytes=memory,
        cpu_shares=shares,
        cpu_quota=quota,
        cpu_period=100_000,
        cpuset_cpus=cpus,
    )


@pytest.mark.skipif(
    (CGROUPS / "cgroup.controllers").exists(), reason="the test reads cgroup v1's files"
)
def test_resource_updates_reach_the_sandboxs_host_cgroup(gvisor: Daemon, short_tmp: Path) -> None:
    # The pod's overhead (kubelet's, from its RuntimeClass) is the sandbox's own share.
    overhead = api_pb2.LinuxPodSandboxConfig(
        overhead=limits(16 * MiB, 128, 10_000),
    )
    with pod(gvisor, "resize", short_tmp, handler="runsc", linux=overhead) as p:
        sandbox_group = f"/cri-shim/{p[0]}"
        configs = {
            "big": limits(64 * MiB, 512, 50_000),
            "small": limits(32 * MiB, 256, 20_000),
        }
        ids = {}
        for name, resources in configs.items():
            config = container_config(name, "exec sleep 300")
            config.linux.resources.CopyFrom(resources)
            ids[name] = create(gvisor, p, config)
            start(gvisor, ids[name])
        # The sandbox, where every container's processes run, holds the pod's total.
        assert cgroup_value(sandbox_group, "memory", "memory.limit_in_bytes") == str(112 * MiB)
        assert cgroup_value(sandbox_group, "cpu", "cpu.shares") == "896"
        assert cgroup_value(sandbox_group, "cpu", "cpu.cfs_quota_us") == "80000"

        gvisor.runtime().UpdateContainerResources(
            api_pb2.UpdateContainerResourcesRequest(
                container_id=ids["big"], linux=limits(128 * MiB, 1024, 100_000, "0")
            ),
            timeout=30,
        )
        assert cgroup_value(sandbox_group, "memory", "memory.limit_in_bytes") == str(176 * MiB)
        assert cgroup_value(sandbox_group, "cpu", "cpu.shares") == "1408"
        assert cgroup_value(sandbox_group, "cpu", "cpu.cfs_quota_us") == "130000"
        # "small" may use every CPU of the pod's parent: so may the sandbox.
        parent = (CGROUPS / "cpuset" / "cri-shim" / "cpuset.cpus").read_text().strip()
        assert cgroup_value(sandbox_group, "cpuset", "cpuset.cpus") == parent
        # The container's own host cgroup and its spec (ContainerStatus) say its limits.
        own = cgroups_path_of(gvisor, ids["big"])
        assert cgroup_value(own, "memory", "memory.limit_in_bytes") == str(128 * MiB)
        assert cgroup_value(own, "cpu", "cpu.cfs_quota_us") == "100000"
        assert cgroup_value(own, "cpuset", "cpuset.cpus") == "0"
        spec = json.loads(status_info(gvisor, ids["big"]))["runtimeSpec"]
        assert spec["linux"]["resources"]["memory"]["limit"] == 128 * MiB
        assert spec["linux"]["resources"]["cpu"]["cpus"] == "0"

        # The kernel enforces the pod's memory limit on the sandbox: at it, the host's OOM
        # killer takes the sandbox (the Sentry), and every container of the pod goes with it.
        # The exec fails (how depends on whether the pod's end is seen first).
        with pytest.raises(grpc.RpcError):
            gvisor.runtime().ExecSync(
                api_pb2.ExecSyncRequest(
                    container_id=ids["small"], cmd=["sh", "-c", "tail /dev/zero"], timeout=60
                ),
                timeout=90,
            )
        oom = cgroup_value(sandbox_group, "memory", "memory.oom_control").splitlines()
        assert "oom_kill 1" in oom, oom
        for container_id in ids.values():
            wait_until(
                lambda c=container_id: status(gvisor, c).state == api_pb2.CONTAINER_EXITED,
                timeout=60,
            )
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def online_cpus() -> str:
    return Path("/sys/devices/system/cpu/online").read_text().strip()


def test_cpusets_beyond_the_hosts_cpus_are_refused_before_anything_is_made(
    gvisor: Daemon, short_tmp: Path
) -> None:
    # A cpuset was once expanded into a set of its numbers to sum the pod's total:
    # "0-8000000" took the daemon to 0.8 GB and seconds; "0-99999999999" would exhaust
    # the node. Each is refused as the request's own error, naming the field.
    beyond = first_missing([(0, 8_000_000)], parse(online_cpus()))
    with pod(gvisor, "cpusets", short_tmp, handler="runsc") as p:
        running = create(gvisor, p, container_config("running", "exec sleep 300"))
        start(gvisor, running)
        refusals = {}
        for cpus in ("0-8000000", "0-99999999999"):
            with pytest.raises(grpc.RpcError) as refused:
                gvisor.runtime().UpdateContainerResources(
                    api_pb2.UpdateContainerResourcesRequest(
                        container_id=running,
                        linux=api_pb2.LinuxContainerResources(cpuset_cpus=cpus),
                    ),
                    timeout=30,
                )
            refusals[cpus] = (refused.value.code(), refused.value.details())
        field = "UpdateContainerResourcesRequest.linux.cpuset_cpus"
        assert refusals == {
            "0-8000000": (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{field}: CPU {beyond} is not online on this host (online: {online_cpus()})",
            ),
            "0-99999999999": (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{field}: '0-99999999999' is not a CPU list: 99999999999 is out of range",
            ),
        }
        # A creation naming a memory node the host lacks makes no container.
        config = container_config("pinned", "exec sleep 300")
        config.linux.resources.cpuset_mems = "0-1000"
        with pytest.raises(grpc.RpcError) as refused:
            create(gvisor, p, config)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "linux.resources.cpuset_mems: memory node 1 is not online" in (
            refused.value.details() or ""
        )
        listed = gvisor.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=10)
        assert [c.id for c in listed.containers] == [running]
        # Within the host's CPUs, the update is applied.
        gvisor.runtime().UpdateContainerResources(
            api_pb2.UpdateContainerResourcesRequest(
                container_id=running, linux=api_pb2.LinuxContainerResources(cpuset_cpus="0")
            ),
            timeout=30,
        )
        spec = json.loads(status_info(gvisor, running))["runtimeSpec"]
        assert spec["linux"]["resources"]["cpu"]["cpus"] == "0"
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


@pytest.mark.skipif(
    (CGROUPS / "cgroup.controllers").exists(), reason="the test reads cgroup v1's files"
)
def test_concurrent_updates_of_one_pod_leave_the_sandbox_its_containers_total(
    gvisor: Daemon, short_tmp: Path
) -> None:
    # Each update sums every container's limits into the sandbox's cgroup: two at once
    # once summed each other's old limits, leaving the pod below its containers' total.
    with pod(gvisor, "racing", short_tmp, handler="runsc") as p:
        ids = []
        for name in ("left", "right"):
            config = container_config(name, "exec sleep 300")
            config.linux.resources.CopyFrom(limits(64 * MiB, 256, 20_000))
            ids.append(create(gvisor, p, config))
            start(gvisor, ids[-1])
        sandbox_group = f"/cri-shim/{p[0]}"

        def update(container_id: str, memory: int) -> None:
            gvisor.runtime().UpdateContainerResources(
                api_pb2.UpdateContainerResourcesRequest(
                    container_id=container_id, linux=limits(memory, 256, 20_000)
                ),
                timeout=30,
            )

        wrong = []
        with ThreadPoolExecutor(2) as pool:
            for round_ in range(30):
                sizes = [(100 + round_) * MiB, (200 + 2 * round_) * MiB]
                list(pool.map(update, ids, sizes))
                total = cgroup_value(sandbox_group, "memory", "memory.limit_in_bytes")
                if total != str(sum(sizes)):
                    wrong.append((round_, int(total) // MiB, sum(sizes) // MiB))
        assert wrong == []
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def waiter_of(daemon: Daemon, container_id: str) -> int:
    """The waiter conmon waits for, of a container that joins a sandbox: conmon's child."""
    (child,) = children_of(conmon_of(daemon, container_id))
    return child


def waiter_ticks(waiter: int) -> int:
    """utime + stime + cutime + cstime: what a waiter and its reaped children used."""
    fields = Path(f"/proc/{waiter}/stat").read_text().rpartition(")")[2].split()
    return sum(int(value) for value in fields[11:15])


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_created_container_waits_for_its_start_without_polling(
    gvisor: Daemon, short_tmp: Path
) -> None:
    # The waiter of a created container once asked `runsc state` every 50 ms (14 % of a
    # core each); it now sleeps until its start, or its removal, wakes it.
    with pod(gvisor, "idle", short_tmp, handler="runsc") as p:
        started = create(gvisor, p, container_config("started", "echo up; exit 3"))
        never = create(gvisor, p, container_config("never", "exec sleep 300"))
        stopped = create(gvisor, p, container_config("stopped", "exec sleep 300"))
        waiters = {c: waiter_of(gvisor, c) for c in (started, never, stopped)}
        # Once its first look at the state is done, a waiter uses no CPU and runs nothing.
        for waiter in waiters.values():
            wait_until(lambda w=waiter: not children_of(w), 30)
        before = {c: waiter_ticks(w) for c, w in waiters.items()}
        time.sleep(2)
        for container_id, waiter in waiters.items():
            assert waiter_ticks(waiter) == before[container_id]
            assert children_of(waiter) == [], f"the waiter of {container_id} runs a command"
        # Its stop (runsc cannot signal a created container) ends it, leaving nothing.
        gvisor.runtime().StopContainer(
            api_pb2.StopContainerRequest(container_id=stopped, timeout=0), timeout=30
        )
        wait_until(lambda: ended(waiters[stopped]), 10)
        # Its start wakes it: the exit is recorded as before.
        start(gvisor, started)
        wait_until(lambda: status(gvisor, started).state == api_pb2.CONTAINER_EXITED, 30)
        assert status(gvisor, started).exit_code == 3
        assert output(status(gvisor, started)) == ["up"]
        # Its removal wakes it: the waiter ends, and its conmon with it (not killed).
        gvisor.runtime().RemoveContainer(
            api_pb2.RemoveContainerRequest(container_id=never), timeout=30
        )
        wait_until(lambda: ended(waiters[never]), 10)
        assert "outlived its container" not in gvisor.log()
    assert runsc_list(gvisor) == []
    assert gvisor.leaks() == {}


class RuntimeChildren:
    """Samples, every few milliseconds, the runtime processes the daemon itself started
    (its children named after the runtime's binary) and keeps the peak."""

    def __init__(self, daemon: Daemon) -> None:
        assert daemon.proc is not None
        self._parent = str(daemon.proc.pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RuntimeChildren:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def count(self) -> int:
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            name, _, rest = stat.partition("(")[2].rpartition(")")
            if name == "runsc" and rest.split()[1] == self._parent:
                found += 1
        return found

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.count())


def timed_out_exec(daemon: Daemon, container_id: str, script: str, timeout: int) -> float:
    """An ExecSync of `sh -c script` that must end at its timeout: the seconds until the
    answer, which must be DEADLINE_EXCEEDED."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as timed_out:
        daemon.runtime().ExecSync(
            api_pb2.ExecSyncRequest(
                container_id=container_id, cmd=["sh", "-c", script], timeout=timeout
            ),
            timeout=120,
        )
    answered = time.monotonic() - started
    assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, timed_out.value
    return answered


def lingering(daemon: Daemon, container_id: str, own: str, seconds: float = 2.0) -> list[str]:
    """What runs in the container besides its own process, over a few looks: a member
    of a relay is briefly alone between its parent's exit and its own fork, which a
    single listing can miss."""
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.update(live_processes(daemon, container_id))
        time.sleep(0.2)
    return sorted(seen - {own})


@contextlib.contextmanager
def probed_container(daemon: Daemon, name: str, log_dir: Path) -> Iterator[str]:
    """A running container (`sleep 300`) of a gVisor pod, to exec in; the pod and all of
    its sandbox gone afterwards, and still running until then."""
    with pod(daemon, name, log_dir, handler="runsc") as p:
        container_id = create(daemon, p, container_config("probed", "exec sleep 300"))
        start(daemon, container_id)
        yield container_id
        assert status(daemon, container_id).state == api_pb2.CONTAINER_RUNNING
    assert runsc_list(daemon) == []
    assert daemon.leaks() == {}


def live_processes(daemon: Daemon, container_id: str) -> list[str]:
    """The commands running in a container, as its own `ps` sees them (zombies aside:
    a process whose parent died is the container's init's to reap, as under runc)."""
    listed = exec_sync(daemon, container_id, ["ps", "-o", "stat,args"]).stdout.decode()
    rows = [line.split(maxsplit=1) for line in listed.splitlines()[1:]]
    return [args for stat, args in rows if not stat.startswith("Z") and args != "ps -o stat,args"]


async def _leave_once_running(url: str, daemon: Daemon, container_id: str) -> None:
    command = await SpdyCommand.start(url, stderr=True, tty=False)
    try:
        await asyncio.to_thread(
            wait_until, lambda: len(live_processes(daemon, container_id)) == 3, 30
        )
    finally:
        await command.close()


def test_an_exec_past_its_timeout_or_left_by_its_client_leaves_none_of_its_processes(
    gvisor: Daemon, short_tmp: Path
) -> None:
    # runsc kills one pid at a time: the exec's shell alone was killed, its background
    # child ran on (one per timed-out probe), holding the output open for seconds more.
    with probed_container(gvisor, "probes", short_tmp) as container_id:
        for command in ("sleep 600 & sleep 601", "sh -c 'sleep 602 & wait' & sleep 603"):
            timed_out_exec(gvisor, container_id, command, timeout=1)
            assert live_processes(gvisor, container_id) == ["sleep 300"], command
        # A streaming exec whose client leaves is killed the same way.
        command = ["sh", "-c", "sleep 998 & sleep 997"]
        request = api_pb2.ExecRequest(container_id=container_id, cmd=command, stdout=True)
        url = gvisor.runtime().Exec(request, timeout=10).url
        asyncio.run(_leave_once_running(url, gvisor, container_id))
        wait_until(lambda: live_processes(gvisor, container_id) == ["sleep 300"], timeout=30)


# What the daemon may run at once to end one timed-out exec in gVisor: the exec's own
# `runsc exec` and one more (the kill, whatever the size of the exec's process tree).
RUNTIME_PROCESSES_PER_EXEC = 2


def test_an_exec_timeout_kills_a_wide_tree_with_a_bounded_number_of_host_processes(
    gvisor: Daemon, short_tmp: Path
) -> None:
    # runsc signals one pid per call: 300 sleepers once cost 101 `runsc kill` at once
    # (one per process, ~17 MiB each), 7.2 s to answer, and a sleeper left alive.
    with probed_container(gvisor, "wide", short_tmp) as container_id:
        script = "for i in $(seq 300); do sleep 1d & done; sleep 1d"
        with RuntimeChildren(gvisor) as children:
            answered = timed_out_exec(gvisor, container_id, script, timeout=3)
        survivors = live_processes(gvisor, container_id)
        print(f"peak runsc children {children.peak}, answered in {answered:.1f}s, "
              f"{len(survivors) - 1} survivors")  # fmt: skip
        assert survivors == ["sleep 300"]
        assert children.peak <= RUNTIME_PROCESSES_PER_EXEC


def test_an_exec_timeout_ends_a_fork_chain_that_grows_while_it_is_killed(
    gvisor: Daemon, short_tmp: Path
) -> None:
    # Each process forks the next and waits for it: every listing of the tree is already
    # short of its newest member, which forks on after the look. And a relay whose every
    # member forks the next and exits: its members are re-parented out of the exec's tree
    # before any listing sees them there.
    chains = {
        "growing": "link() { link & wait; }; link",
        "relay": "link() { sleep 0.05; link & }; link; sleep 1d",
    }
    with probed_container(gvisor, "chain", short_tmp) as container_id:
        for name, script in chains.items():
            with RuntimeChildren(gvisor) as children:
                answered = timed_out_exec(gvisor, container_id, script, timeout=2)
            survivors = lingering(gvisor, container_id, "sleep 300")
            print(f"{name}: peak runsc children {children.peak}, answered in {answered:.1f}s, "
                  f"survivors {survivors}")  # fmt: skip
            assert survivors == [], name
            assert children.peak <= RUNTIME_PROCESSES_PER_EXEC, name
