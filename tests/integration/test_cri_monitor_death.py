"""A container whose conmon dies, against the real daemon: the daemon notices at once (or
at its next start), deletes the runtime's container so that nothing runs unmonitored,
reports the container exited with 255 and why, and leaves nothing behind once it is
removed. A pod's pause process losing its conmon makes the pod not ready."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, conmon_of, runtime_leaks, wait_until
from tests.integration.cri_testkit import (
    container_config,
    create,
    event_stream,
    import_image,
    pod,
    pod_state,
    remove,
    start,
    status,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def container_pid(daemon: Daemon, container_id: str) -> int:
    request = api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True)
    reply = daemon.runtime().ContainerStatus(request, timeout=10)
    return int(json.loads(reply.info["info"])["pid"])


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # dead; a zombie is the reaper's


def assert_ended_by_its_monitors_death(daemon: Daemon, container_id: str) -> None:
    st = status(daemon, container_id)
    assert st.state == api_pb2.CONTAINER_EXITED
    assert st.exit_code == 255
    assert st.reason == "Error"
    assert "monitor (conmon) died" in st.message, st.message
    assert st.finished_at >= st.started_at
    assert container_id not in daemon.runc_containers()


def test_a_killed_conmon_ends_its_container(daemon: Daemon, image: None, short_tmp: Path) -> None:
    with pod(daemon, "monitored", short_tmp) as p:
        container_id = create(daemon, p, container_config("c", "echo up; exec sleep 300"))
        start(daemon, container_id)
        process = container_pid(daemon, container_id)
        with event_stream(daemon) as events:
            os.kill(conmon_of(daemon, container_id), signal.SIGKILL)
            events.expect(container_id, api_pb2.CONTAINER_STOPPED_EVENT, timeout=30)
        assert_ended_by_its_monitors_death(daemon, container_id)
        wait_until(lambda: gone(process))  # killed, not left running unmonitored
        remove(daemon, container_id)
    assert daemon.leaks() == {}, daemon.log()
    assert runtime_leaks(daemon) == {}


def assert_refused_as_unmonitored(daemon: Daemon, container_id: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        start(daemon, container_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "monitor (conmon) died before it was started" in refused.value.details()
    st = status(daemon, container_id)
    assert (st.state, st.exit_code, st.reason) == (api_pb2.CONTAINER_EXITED, 255, "Error")
    assert "monitor (conmon) died before it was started" in st.message, st.message
    assert st.started_at == 0
    assert container_id not in daemon.runc_containers()


def test_a_container_whose_conmon_died_before_it_started_cannot_start(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "unstarted", short_tmp) as p:
        noticed = create(daemon, p, container_config("noticed", "exec sleep 300"))
        with event_stream(daemon) as events:
            os.kill(conmon_of(daemon, noticed), signal.SIGKILL)
            # Reported exited, as soon as the daemon notices: it will never run.
            events.expect(noticed, api_pb2.CONTAINER_STOPPED_EVENT, timeout=30)
        assert_refused_as_unmonitored(daemon, noticed)
        # Started at once, maybe before the daemon noticed: refused all the same.
        at_once = create(daemon, p, container_config("at-once", "exec sleep 300"))
        conmon = conmon_of(daemon, at_once)
        os.kill(conmon, signal.SIGKILL)
        wait_until(lambda: gone(conmon))
        assert_refused_as_unmonitored(daemon, at_once)
        remove(daemon, noticed)
        remove(daemon, at_once)
    assert daemon.leaks() == {}, daemon.log()
    assert runtime_leaks(daemon) == {}


def test_a_conmon_killed_while_the_daemon_is_down_is_found_at_restart(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "adopted", short_tmp) as p:
        container_id = create(daemon, p, container_config("c", "exec sleep 300"))
        start(daemon, container_id)
        process = container_pid(daemon, container_id)
        conmon = conmon_of(daemon, container_id)
        daemon.kill9()
        os.kill(conmon, signal.SIGKILL)
        wait_until(lambda: gone(conmon))
        daemon.start()
        # Restored before serving: the first answer already knows.
        assert_ended_by_its_monitors_death(daemon, container_id)
        wait_until(lambda: gone(process))
        remove(daemon, container_id)
    assert daemon.leaks() == {}, daemon.log()
    assert runtime_leaks(daemon) == {}


def test_conmons_adopted_at_restart_are_watched(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "readopted", short_tmp) as p:
        container_id = create(daemon, p, container_config("c", "exec sleep 300"))
        start(daemon, container_id)
        daemon.restart()
        assert status(daemon, container_id).state == api_pb2.CONTAINER_RUNNING
        os.kill(conmon_of(daemon, container_id), signal.SIGKILL)
        wait_until(
            lambda: status(daemon, container_id).state == api_pb2.CONTAINER_EXITED, timeout=30
        )
        assert_ended_by_its_monitors_death(daemon, container_id)
        remove(daemon, container_id)
    assert daemon.leaks() == {}, daemon.log()
    assert runtime_leaks(daemon) == {}


def test_a_pod_whose_pause_conmon_dies_is_not_ready(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    shared = api_pb2.NamespaceOption(pid=api_pb2.POD)
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=shared)
    )
    with pod(daemon, "pause", short_tmp, linux=linux) as p:
        sandbox_id = p[0]
        config = container_config(
            "c",
            "exec sleep 300",
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(namespace_options=shared)
            ),
        )
        container_id = create(daemon, p, config)
        start(daemon, container_id)
        os.kill(conmon_of(daemon, sandbox_id), signal.SIGKILL)

        wait_until(lambda: pod_state(daemon, sandbox_id) == api_pb2.SANDBOX_NOTREADY, timeout=30)
        assert sandbox_id not in daemon.runc_containers()
        # The pod's PID namespace went with its init: its container exited with it.
        wait_until(
            lambda: status(daemon, container_id).state == api_pb2.CONTAINER_EXITED, timeout=30
        )
    assert daemon.leaks() == {}, daemon.log()
    assert runtime_leaks(daemon) == {}
