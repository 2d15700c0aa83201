"""NRI through the real daemon: a plugin connected over the real socket is synchronized
with the pods that exist, sees every event of a container's life in order, adjusts a
container's environment and memory limit (which the container then has), and fails a
creation that then leaves nothing behind and frees its name."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.message import Message

from cri_shim.api.v1 import api_pb2
from cri_shim.nri.api import api_pb2 as nri
from tests.harness import Daemon
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    output,
    pod,
    remove,
    run_to_exit,
    start,
)
from tests.nri_plugin import PluginThread, RecordingPlugin, fail_with
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.root]

LIMIT = 48 << 20
T = TypeVar("T")
MEMORY_LIMIT = (
    "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
)
SCRIPT = 'echo "env $NRI_ADDED"; ' + MEMORY_LIMIT


def adjust(request: Message) -> Message:
    assert isinstance(request, nri.CreateContainerRequest)
    if request.container.name == "refused":
        raise fail_with("refused by the test plugin")(request)
    response = nri.CreateContainerResponse()
    response.adjust.env.add(key="NRI_ADDED", value="by-plugin")
    response.adjust.linux.resources.memory.limit.value = LIMIT
    return response


@pytest.fixture
def nri_daemon(make_daemon: Any, short_tmp: Path, busybox_layout: Path) -> Daemon:
    daemon: Daemon = make_daemon(
        settings={"nri": {"enable": True, "socket_path": str(short_tmp / "nri.sock")}}
    )
    daemon.start()
    import_image(daemon, busybox_layout)
    return daemon


def plugin_call(plugin: RecordingPlugin, call: Coroutine[Any, Any, T]) -> T:
    """Run one of the plugin's calls on its own loop, from the test's thread."""
    assert plugin.loop is not None
    return asyncio.run_coroutine_threadsafe(call, plugin.loop).result(timeout=30)


@pytest.fixture
def plugin(nri_daemon: Daemon, short_tmp: Path) -> Iterator[RecordingPlugin]:
    thread = PluginThread(
        RecordingPlugin(responders={"CreateContainer": adjust}), short_tmp / "nri.sock"
    )
    yield thread.start()
    thread.stop()


def test_a_plugin_adjusts_a_container_and_sees_its_life_in_order(
    nri_daemon: Daemon, short_tmp: Path
) -> None:
    with pod(nri_daemon, "before", short_tmp) as existing:
        thread = PluginThread(
            RecordingPlugin(responders={"CreateContainer": adjust}), short_tmp / "nri.sock"
        )
        plugin = thread.start()
        wait_until(lambda: "Synchronize" in plugin.methods)
        sync = plugin.calls[1][1]
        assert isinstance(sync, nri.SynchronizeRequest)
        assert [p.id for p in sync.pods] == [existing[0]]

        st = run_to_exit(nri_daemon, existing, container_config("adjusted", SCRIPT))
        assert st.exit_code == 0, output(st, "stderr")
        assert output(st) == ["env by-plugin", str(LIMIT)]
        remove(nri_daemon, st.id)
    try:
        wait_until(lambda: "RemovePodSandbox" in plugin.methods)
        assert plugin.methods == [
            "Configure",
            "Synchronize",
            "CreateContainer",
            "PostCreateContainer",
            "StartContainer",
            "PostStartContainer",
            "StopContainer",  # it exited by itself
            "RemoveContainer",
            "StopPodSandbox",
            "RemovePodSandbox",
        ]
    finally:
        thread.stop()


def test_pod_events_come_once_per_pod(
    nri_daemon: Daemon, plugin: RecordingPlugin, short_tmp: Path
) -> None:
    with pod(nri_daemon, "counted", short_tmp) as p:
        wait_until(lambda: "RunPodSandbox" in plugin.methods)
        run = plugin.calls[plugin.methods.index("RunPodSandbox")][1]
        assert isinstance(run, nri.RunPodSandboxRequest)
        assert (run.pod.id, run.pod.name, run.pod.namespace) == (p[0], "counted", "default")
    wait_until(lambda: "RemovePodSandbox" in plugin.methods)
    pod_events = [m for m in plugin.methods if "PodSandbox" in m]
    assert pod_events == ["RunPodSandbox", "StopPodSandbox", "RemovePodSandbox"]


def test_a_refused_creation_leaves_nothing_and_frees_its_name(
    nri_daemon: Daemon, plugin: RecordingPlugin, short_tmp: Path
) -> None:
    with pod(nri_daemon, "refusing", short_tmp) as p:
        with pytest.raises(grpc.RpcError) as err:
            create(nri_daemon, p, container_config("refused", "true"))
        assert "refused by the test plugin" in err.value.details()
        assert not nri_daemon.rows("containers")
        # The plugin heard of the container's end, as of its beginning.
        wait_until(lambda: "RemoveContainer" in plugin.methods)
        plugin.responders.pop("CreateContainer")
        started = time.monotonic()
        container_id = create(nri_daemon, p, container_config("refused", "true"))
        assert container_id and time.monotonic() - started < 30
        remove(nri_daemon, container_id)
    assert nri_daemon.leaks() == {}


def test_a_plugin_updates_a_running_containers_memory_limit(
    nri_daemon: Daemon, plugin: RecordingPlugin, short_tmp: Path
) -> None:
    with pod(nri_daemon, "updated", short_tmp) as p:
        container_id = create(nri_daemon, p, container_config("long", "sleep 60"))
        start(nri_daemon, container_id)
        update = nri.ContainerUpdate(container_id=container_id)
        update.linux.resources.memory.limit.value = 2 * LIMIT
        answer = plugin_call(plugin, plugin.update_containers([update]))
        assert list(answer.failed) == []
        got = exec_sync(nri_daemon, container_id, ["sh", "-c", MEMORY_LIMIT])
        assert got.stdout.decode().strip() == str(2 * LIMIT)
        remove(nri_daemon, container_id)


def raise_memory(request: Message) -> Message:
    assert isinstance(request, nri.UpdateContainerRequest)
    if request.linux_resources.memory.limit.value == 3 * LIMIT:
        raise fail_with("update refused by the test plugin")(request)
    response = nri.UpdateContainerResponse()
    update = response.update.add(container_id=request.container.id)
    update.linux.resources.memory.limit.value = 2 * LIMIT
    return response


def test_plugins_change_a_cri_update_or_refuse_it_and_hear_what_was_applied(
    nri_daemon: Daemon, plugin: RecordingPlugin, short_tmp: Path
) -> None:
    plugin.responders["UpdateContainer"] = raise_memory
    with pod(nri_daemon, "cri-updated", short_tmp) as p:
        container_id = create(nri_daemon, p, container_config("long", "sleep 60"))
        start(nri_daemon, container_id)
        nri_daemon.runtime().UpdateContainerResources(
            api_pb2.UpdateContainerResourcesRequest(
                container_id=container_id,
                linux=api_pb2.LinuxContainerResources(memory_limit_in_bytes=LIMIT),
            ),
            timeout=30,
        )
        got = exec_sync(nri_daemon, container_id, ["sh", "-c", MEMORY_LIMIT])
        assert got.stdout.decode().strip() == str(2 * LIMIT)
        asked = plugin.calls[plugin.methods.index("UpdateContainer")][1]
        assert isinstance(asked, nri.UpdateContainerRequest)
        assert asked.container.id == container_id
        assert asked.linux_resources.memory.limit.value == LIMIT
        wait_until(lambda: "PostUpdateContainer" in plugin.methods)
        told = plugin.calls[plugin.methods.index("PostUpdateContainer")][1]
        assert isinstance(told, nri.PostUpdateContainerRequest)
        assert told.container.linux.resources.memory.limit.value == 2 * LIMIT

        with pytest.raises(grpc.RpcError) as err:
            nri_daemon.runtime().UpdateContainerResources(
                api_pb2.UpdateContainerResourcesRequest(
                    container_id=container_id,
                    linux=api_pb2.LinuxContainerResources(memory_limit_in_bytes=3 * LIMIT),
                ),
                timeout=30,
            )
        assert "NRI plugin 10-recorder: update refused by the test plugin" in err.value.details()
        got = exec_sync(nri_daemon, container_id, ["sh", "-c", MEMORY_LIMIT])
        assert got.stdout.decode().strip() == str(2 * LIMIT)
        assert plugin.methods.count("PostUpdateContainer") == 1
        remove(nri_daemon, container_id)


def refuse_big_pods(request: Message) -> Message:
    assert isinstance(request, nri.UpdatePodSandboxRequest)
    if request.linux_resources.memory.limit.value > 4 * LIMIT:
        raise fail_with("pod too big for this node")(request)
    return nri.UpdatePodSandboxResponse()


def test_plugins_are_asked_about_a_pod_resize_and_told_of_it(
    nri_daemon: Daemon, plugin: RecordingPlugin, short_tmp: Path
) -> None:
    plugin.responders["UpdatePodSandbox"] = refuse_big_pods
    runtime = nri_daemon.runtime()
    with pod(nri_daemon, "resized", short_tmp) as p:
        sandbox_id = p[0]

        def resize(limit: int) -> None:
            runtime.UpdatePodSandboxResources(
                api_pb2.UpdatePodSandboxResourcesRequest(
                    pod_sandbox_id=sandbox_id,
                    resources=api_pb2.LinuxContainerResources(memory_limit_in_bytes=limit),
                    overhead=api_pb2.LinuxContainerResources(cpu_shares=64),
                ),
                timeout=30,
            )

        resize(2 * LIMIT)
        wait_until(lambda: "PostUpdatePodSandbox" in plugin.methods)
        asked = plugin.calls[plugin.methods.index("UpdatePodSandbox")][1]
        assert isinstance(asked, nri.UpdatePodSandboxRequest)
        assert asked.pod.id == sandbox_id
        assert asked.linux_resources.memory.limit.value == 2 * LIMIT
        assert asked.overhead_linux_resources.cpu.shares.value == 64
        told = plugin.calls[plugin.methods.index("PostUpdatePodSandbox")][1]
        assert isinstance(told, nri.PostUpdatePodSandboxRequest)
        assert told.pod.id == sandbox_id

        with pytest.raises(grpc.RpcError) as err:
            resize(8 * LIMIT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "pod too big for this node" in err.value.details()
        # Refused: not recorded, and no PostUpdatePodSandbox for it.
        verbose = runtime.PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=30
        )
        recorded = json.loads(verbose.info["info"])["resources"]
        assert int(recorded["resources"]["memory_limit_in_bytes"]) == 2 * LIMIT
        assert plugin.methods.count("PostUpdatePodSandbox") == 1


def test_a_retry_answered_from_the_cache_is_no_second_creation_for_plugins(
    make_daemon: Any, short_tmp: Path, busybox_layout: Path
) -> None:
    socket = short_tmp / "nri.sock"
    daemon: Daemon = make_daemon(
        settings={
            "nri": {"enable": True, "socket_path": str(socket), "plugin_request_timeout": "10s"},
            "creation": {"claim_grace": "2s"},
        }
    )
    daemon.start()
    import_image(daemon, busybox_layout)
    # A plugin slow to answer CreateContainer makes kubelet's call time out.
    thread = PluginThread(RecordingPlugin(delays={"CreateContainer": 1.5}), socket)
    plugin = thread.start()
    try:
        with pod(daemon, "retried", short_tmp) as p:
            request = api_pb2.CreateContainerRequest(
                pod_sandbox_id=p[0], config=container_config("slow", "true"), sandbox_config=p[1]
            )
            with pytest.raises(grpc.RpcError) as err:
                daemon.runtime().CreateContainer(request, timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: "PostCreateContainer" in plugin.methods)
            # The retry gets the cached container; plugins heard of it once.
            claimed = daemon.runtime().CreateContainer(request, timeout=30).container_id
            assert plugin.methods.count("CreateContainer") == 1
            created = plugin.calls[plugin.methods.index("CreateContainer")][1]
            assert isinstance(created, nri.CreateContainerRequest)
            assert created.container.id == claimed

            # One left unclaimed expires: the plugin hears of its removal.
            unclaimed = api_pb2.CreateContainerRequest(
                pod_sandbox_id=p[0], config=container_config("left", "true"), sandbox_config=p[1]
            )
            with pytest.raises(grpc.RpcError):
                daemon.runtime().CreateContainer(unclaimed, timeout=0.5)
            wait_until(lambda: plugin.methods.count("RemoveContainer") == 1, timeout=60)
            removed = plugin.calls[plugin.methods.index("RemoveContainer")][1]
            assert isinstance(removed, nri.RemoveContainerRequest)
            assert removed.container.name == "left"
            remove(daemon, claimed)
        assert daemon.leaks() == {}
    finally:
        thread.stop()


# A pre-installed plugin: the RecordingPlugin over the fd the daemon passes, which writes
# its pid, its configuration and every call it gets to files beside it, for the test.
LAUNCHED_PLUGIN = """#!{python}
import asyncio, os, sys
sys.path.insert(0, {root!r})
from cri_shim.nri.api import api_pb2 as nri
from tests.nri_plugin import RecordingPlugin

out = {out!r}

def adjust(request):
    response = nri.CreateContainerResponse()
    response.adjust.env.add(key="NRI_ADDED", value="pre-installed")
    return response

def record(method, request):
    with open(out + "/calls", "a") as f:
        f.write(method + "\\n")
        if method == "Configure":
            f.write("config " + request.config + "\\n")

class Recording(RecordingPlugin):
    def _handler(self, method):
        handle = super()._handler(method)
        async def recorded(payload):
            answer = await handle(payload)
            record(method, self.calls[-1][1])
            return answer
        return recorded

async def main():
    with open(out + "/pid", "w") as f:
        f.write(str(os.getpid()))
    plugin = Recording(
        name=os.environ["NRI_PLUGIN_NAME"],
        index=os.environ["NRI_PLUGIN_IDX"],
        responders={{"CreateContainer": adjust}},
    )
    await plugin.connect_inherited(int(os.environ["NRI_PLUGIN_SOCKET"]))
    assert plugin.connection is not None
    await plugin.connection.closed.wait()

asyncio.run(main())
"""


def test_a_pre_installed_plugin_is_launched_configured_served_and_stopped(
    make_daemon: Any, short_tmp: Path, busybox_layout: Path
) -> None:
    plugins, configs, out = short_tmp / "plugins", short_tmp / "conf.d", short_tmp / "out"
    for directory in (plugins, configs, out):
        directory.mkdir()
    script = plugins / "20-launched"
    script.write_text(
        LAUNCHED_PLUGIN.format(
            python=sys.executable, root=str(Path(__file__).parents[2]), out=str(out)
        )
    )
    script.chmod(0o755)
    (plugins / "not-a-plugin").write_text("")
    (configs / "launched.conf").write_text("answer = 42")
    daemon: Daemon = make_daemon(
        settings={
            "nri": {
                "enable": True,
                "socket_path": str(short_tmp / "nri.sock"),
                "plugin_path": str(plugins),
                "plugin_config_path": str(configs),
            }
        }
    )
    daemon.start()
    import_image(daemon, busybox_layout)
    calls = out / "calls"

    def seen() -> list[str]:
        return calls.read_text().splitlines() if calls.exists() else []

    wait_until(lambda: "Synchronize" in seen())
    pid = int((out / "pid").read_text())
    with pod(daemon, "launched", short_tmp) as p:
        st = run_to_exit(daemon, p, container_config("adjusted", 'echo "env $NRI_ADDED"'))
        assert output(st) == ["env pre-installed"]
        remove(daemon, st.id)
    wait_until(lambda: "RemovePodSandbox" in seen())
    assert seen()[:5] == [
        "Configure",
        "config answer = 42",
        "Synchronize",
        "RunPodSandbox",
        "CreateContainer",
    ]
    daemon.stop()
    assert seen()[-1] == "Shutdown"
    assert not Path(f"/proc/{pid}").exists()
