"""Containers against the real daemon: runc under conmon, overlay rootfs from an imported image."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.crilog import join_partials, read_records
from tests.harness import REPO, Daemon, import_image, pod_config, wait_until
from tests.integration import cri_testkit
from tests.integration.cri_testkit import create, start, status

pytestmark = [pytest.mark.integration, pytest.mark.root]

IMAGE = "docker.io/library/busybox:latest"


@pytest.fixture
def pod(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> Iterator[tuple[str, api_pb2.PodSandboxConfig]]:
    import_image(daemon, busybox_layout)
    config = pod_config("ctr-pod", log_directory=str(short_tmp / "logs"))
    sandbox_id = (
        daemon.runtime()
        .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=30)
        .pod_sandbox_id
    )
    yield sandbox_id, config
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )


def container_config(name: str, args: list[str], **kwargs: object) -> api_pb2.ContainerConfig:
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name=name),
        image=api_pb2.ImageSpec(image=kwargs.pop("image", IMAGE)),  # type: ignore[arg-type]
        command=kwargs.pop("command", ["/bin/sh", "-c"]),  # type: ignore[arg-type]
        args=args,
        log_path=f"{name}.log",
        **kwargs,  # type: ignore[arg-type]
    )


def run_to_exit(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], config: api_pb2.ContainerConfig
) -> api_pb2.ContainerStatus:
    return cri_testkit.run_to_exit(daemon, pod, config, timeout=20)


def log_lines(path: str, stream: str | None = None) -> list[str]:
    messages = join_partials(read_records(Path(path)))
    return [m.content.decode() for m in messages if stream is None or m.stream == stream]


def exec_sync(
    daemon: Daemon, container_id: str, cmd: list[str], timeout: int = 0
) -> api_pb2.ExecSyncResponse:
    return daemon.runtime().ExecSync(
        api_pb2.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=timeout), timeout=60
    )


def test_exit_code_and_cri_log(daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]) -> None:
    st = run_to_exit(daemon, pod, container_config("logs", ["echo out; echo err >&2; exit 3"]))
    assert st.exit_code == 3
    assert st.reason == "Error"
    assert st.started_at > 0 and st.finished_at >= st.started_at
    assert st.log_path.endswith("logs.log")
    assert log_lines(st.log_path, "stdout") == ["out"]
    assert log_lines(st.log_path, "stderr") == ["err"]
    ok = run_to_exit(daemon, pod, container_config("ok", ["true"]))
    assert ok.exit_code == 0 and ok.reason == "Completed"


def test_env_workdir_and_image_user(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    st = run_to_exit(
        daemon,
        pod,
        container_config(
            "env",
            ["echo $GREETING; pwd; id -u; id -un"],
            envs=[api_pb2.KeyValue(key="GREETING", value=b"hello")],
            working_dir="/tmp",
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(run_as_username="app")
            ),
        ),
    )
    assert log_lines(st.log_path) == ["hello", "/tmp", "1000", "app"]


def test_read_only_rootfs_and_host_mounts(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    rw, ro = short_tmp / "rw", short_tmp / "ro"
    rw.mkdir()
    ro.mkdir()
    (ro / "data").write_text("from host\n")
    st = run_to_exit(
        daemon,
        pod,
        container_config(
            "mounts",
            [
                "cat /ro/data; echo written > /rw/out; touch /ro/x || echo ro-refused; "
                "touch /newfile || echo rootfs-refused"
            ],
            mounts=[
                api_pb2.Mount(container_path="/rw", host_path=str(rw)),
                api_pb2.Mount(container_path="/ro", host_path=str(ro), readonly=True),
            ],
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(readonly_rootfs=True)
            ),
        ),
    )
    assert log_lines(st.log_path, "stdout") == ["from host", "ro-refused", "rootfs-refused"]
    assert (rw / "out").read_text() == "written\n"


def _cap_eff(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], name: str, caps: api_pb2.Capability
) -> int:
    st = run_to_exit(
        daemon,
        pod,
        container_config(
            name,
            ["grep CapEff /proc/self/status"],
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(capabilities=caps)
            ),
        ),
    )
    return int(log_lines(st.log_path)[0].split()[1], 16)


def test_capabilities_added_and_dropped(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    cap_net_admin, cap_chown = 1 << 12, 1 << 0
    default = _cap_eff(daemon, pod, "caps-default", api_pb2.Capability())
    assert default & cap_chown and not default & cap_net_admin
    changed = _cap_eff(
        daemon,
        pod,
        "caps-changed",
        api_pb2.Capability(add_capabilities=["NET_ADMIN"], drop_capabilities=["CHOWN"]),
    )
    assert changed & cap_net_admin and not changed & cap_chown


def test_exec_sync_and_its_timeout(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    container_id = create(daemon, pod, container_config("sleeper", ["sleep 300"]))
    start(daemon, container_id)
    result = exec_sync(daemon, container_id, ["sh", "-c", "echo hi; echo oops >&2; exit 7"])
    assert (result.stdout, result.stderr, result.exit_code) == (b"hi\n", b"oops\n", 7)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        exec_sync(daemon, container_id, ["sleep", "60"], timeout=1)
    assert time.monotonic() - t0 < 10
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the timed-out process is gone
    ps = exec_sync(daemon, container_id, ["ps", "-o", "args"])
    assert b"sleep 60" not in ps.stdout
    daemon.runtime().RemoveContainer(
        api_pb2.RemoveContainerRequest(container_id=container_id), timeout=60
    )


def test_exec_sync_racing_the_containers_exit_is_a_failed_precondition(
    make_daemon: Callable[..., Daemon], busybox_layout: Path, short_tmp: Path
) -> None:
    # kubelet's probes race a container's exit; runc then fails to join namespaces that
    # are gone. That is a container not running (FAILED_PRECONDITION), not INTERNAL.
    racing = REPO / "tests" / "fixtures" / "runtime" / "exit-racing-runc"
    daemon = make_daemon(settings={"runtime": {"handlers": {"racing": {"path": str(racing)}}}})
    daemon.start()
    import_image(daemon, busybox_layout)
    with cri_testkit.pod(daemon, "racing", short_tmp, handler="racing") as p:
        container_id = create(daemon, p, container_config("dying", ["sleep 300"]))
        start(daemon, container_id)
        with pytest.raises(grpc.RpcError) as info:
            exec_sync(daemon, container_id, ["true"])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is not running" in info.value.details()


def test_stop_escalates_to_sigkill(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    container_id = create(
        daemon,
        pod,
        container_config("stubborn", ["trap '' TERM; echo trapped; while true; do sleep 1; done"]),
    )
    start(daemon, container_id)
    # The shell has installed its trap once it prints.
    wait_until(lambda: "trapped" in log_lines(status(daemon, container_id).log_path))
    t0 = time.monotonic()
    daemon.runtime().StopContainer(
        api_pb2.StopContainerRequest(container_id=container_id, timeout=2), timeout=60
    )
    took = time.monotonic() - t0
    st = status(daemon, container_id)
    assert st.state == api_pb2.CONTAINER_EXITED
    assert st.exit_code == 137
    assert 1.5 < took < 15
    # idempotent
    daemon.runtime().StopContainer(
        api_pb2.StopContainerRequest(container_id=container_id, timeout=2), timeout=60
    )


def test_a_stop_before_the_init_set_its_handler_reaches_the_handler(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    """The shell is its PID namespace's init: a SIGTERM sent while it still sleeps, before
    its trap exists, is discarded by the kernel. The runtime sends it again once the trap is
    set, so the container ends by its handler (exit 0), not by SIGKILL (137) 20 s later."""
    container_id = create(
        daemon,
        pod,
        container_config(
            "late-trap",
            ["sleep 1; trap 'echo handled; exit 0' TERM; while true; do sleep 0.1; done"],
        ),
    )
    start(daemon, container_id)
    daemon.runtime().StopContainer(
        api_pb2.StopContainerRequest(container_id=container_id, timeout=20), timeout=60
    )
    st = status(daemon, container_id)
    assert st.state == api_pb2.CONTAINER_EXITED
    assert st.exit_code == 0, st.reason
    assert "handled" in log_lines(st.log_path)


def test_memory_limit_reports_oomkilled(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    st = run_to_exit(
        daemon,
        pod,
        container_config(
            "hog",
            ["dd if=/dev/zero of=/dev/shm/fill bs=1M count=200; tail /dev/zero"],
            linux=api_pb2.LinuxContainerConfig(
                resources=api_pb2.LinuxContainerResources(memory_limit_in_bytes=32 * 1024 * 1024)
            ),
        ),
    )
    assert st.reason == "OOMKilled"
    assert st.exit_code == 137


def test_list_and_filters(daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]) -> None:
    a = create(daemon, pod, container_config("a", ["sleep 300"], labels={"role": "a"}))
    b = create(daemon, pod, container_config("b", ["sleep 300"], labels={"role": "b"}))
    start(daemon, a)

    def ids(f: api_pb2.ContainerFilter) -> list[str]:
        return [
            c.id
            for c in daemon.runtime()
            .ListContainers(api_pb2.ListContainersRequest(filter=f), timeout=5)
            .containers
        ]

    running = api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_RUNNING)
    assert ids(api_pb2.ContainerFilter(state=running)) == [a]
    assert ids(api_pb2.ContainerFilter(label_selector={"role": "b"})) == [b]
    assert ids(api_pb2.ContainerFilter(pod_sandbox_id=pod[0])) == [a, b]
    assert ids(api_pb2.ContainerFilter(id=b[:12])) == [b]
    pod_status = daemon.runtime().PodSandboxStatus(
        api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod[0]), timeout=5
    )
    assert {c.id for c in pod_status.containers_statuses} == {a, b}


def test_stopping_the_pod_stops_its_containers_and_removal_leaves_nothing(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    config = pod_config("doomed", log_directory=str(short_tmp / "logs"))
    sandbox_id = (
        daemon.runtime()
        .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=30)
        .pod_sandbox_id
    )
    pod = (sandbox_id, config)
    container_id = create(daemon, pod, container_config("main", ["sleep 300"]))
    start(daemon, container_id)
    info = (
        daemon.runtime()
        .ContainerStatus(
            api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=5
        )
        .info["info"]
    )
    pid = int(json.loads(info)["pid"])
    assert Path(f"/proc/{pid}").exists()
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )
    assert status(daemon, container_id).state == api_pb2.CONTAINER_EXITED
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=10)
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )
    leaks = daemon.leaks()
    assert leaks == {}
    runc_list = subprocess.run(
        ["runc", "--root", str(daemon.run_root / "runtime" / "runc"), "list", "-q"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert runc_list == []
    assert not list((daemon.root / "containers").glob("*"))


def test_bad_input(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    plain_file = short_tmp / "plain-file"
    plain_file.write_text("")

    def code(config: api_pb2.ContainerConfig, sandbox: str | None = None) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as info:
            create(daemon, (sandbox or pod[0], pod[1]), config)
        return info.value.code()

    assert code(container_config("x", ["true"]), sandbox="0" * 64) == grpc.StatusCode.NOT_FOUND
    assert code(container_config("x", ["true"], image="nope:latest")) == grpc.StatusCode.NOT_FOUND
    assert (
        code(
            container_config(
                "x", ["true"], mounts=[api_pb2.Mount(container_path="/m", host_path="relative/p")]
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code(
            container_config(
                "x",
                ["true"],
                # Below a file: no directory can be made there (a missing one would be).
                mounts=[api_pb2.Mount(container_path="/m", host_path=str(plain_file / "below"))],
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert code(container_config("", ["true"])) == grpc.StatusCode.INVALID_ARGUMENT
    # nothing half-made: no container listed, no container directory, no reservation
    assert (
        daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=5).containers == []
    )
    assert daemon.rows("containers") == []
    assert daemon.rows("names", "kind = 'container'") == []
    with pytest.raises(grpc.RpcError) as info:
        status(daemon, "f" * 64)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # a stopped sandbox refuses new containers
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod[0]), timeout=60
    )
    assert code(container_config("late", ["true"])) == grpc.StatusCode.FAILED_PRECONDITION


def test_a_failed_creation_takes_its_log_file_with_it(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    # kubelet numbers the next attempt after the log files it finds (0.log, 1.log, ...)
    # when it knows no container of the name: a file left by a failed creation would be
    # counted as a restart that never happened.
    config = container_config("broken", [], command=["/no/such/binary"])
    config.log_path = "broken/0.log"
    with pytest.raises(grpc.RpcError) as info:
        create(daemon, pod, config)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert not (short_tmp / "logs" / "broken" / "0.log").exists()
    assert (
        daemon.rows("containers") == [] and daemon.rows("journal", "action = 'container_log'") == []
    )
    # a container that was created keeps its log after removal: kubelet removes it itself
    config = container_config("kept", ["echo kept"])
    container_id = run_to_exit(daemon, pod, config).id
    cri_testkit.remove(daemon, container_id)
    assert log_lines(str(short_tmp / "logs" / "kept.log")) == ["kept"]


def test_image_service_sees_imported_image(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig]
) -> None:
    images = daemon.images().ListImages(api_pb2.ListImagesRequest(), timeout=5).images
    assert any(IMAGE in i.repo_tags for i in images)


def test_restart_keeps_running_container_and_picks_up_exit(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], short_tmp: Path
) -> None:
    flag = short_tmp / "flag"
    flag.mkdir()
    container_id = create(
        daemon,
        pod,
        container_config(
            "survivor",
            ["while [ ! -e /flag/go ]; do sleep 0.2; done; exit 5"],
            mounts=[api_pb2.Mount(container_path="/flag", host_path=str(flag))],
        ),
    )
    start(daemon, container_id)
    daemon.kill9()
    (flag / "go").write_text("")
    # The container exits while the daemon is down: conmon records its exit code.
    exit_file = daemon.run_root / "conmon" / "runc" / "exits" / container_id
    wait_until(lambda: exit_file.exists() and exit_file.read_text().strip())
    daemon.start()
    st = status(daemon, container_id)
    assert st.state == api_pb2.CONTAINER_EXITED
    assert st.exit_code == 5
