"""NRI through the real daemon: a plugin connected over the real socket is synchronized
with the pods that exist, sees every event of a container's life in order, adjusts a
container's environment and memory limit (which the container then has), and fails a
creation that then leaves nothing behind and frees its name."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.message import Message

from cri_shim.api.v1 import api_pb2
from cri_shim.nri import mux, ttrpc
from cri_shim.nri.adaptation import MAX_UPDATES, RUNTIME_SERVICE
from cri_shim.nri.api import api_pb2 as nri
from cri_shim.nri.api import ttrpc_pb2
from cri_shim.nri.ttrpc import CallError, Code
from tests.harness import Daemon, pod_config
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    output,
    pod,
    remove,
    remove_pod,
    run_pod,
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


def nri_daemon_with(
    make_daemon: Any, short_tmp: Path, image: Path | None = None, **nri: Any
) -> Daemon:
    """A daemon serving NRI on short_tmp/nri.sock, with these [nri] settings."""
    daemon: Daemon = make_daemon(
        settings={"nri": {"enable": True, "socket_path": str(short_tmp / "nri.sock"), **nri}}
    )
    daemon.start()
    if image is not None:
        import_image(daemon, image)
    return daemon


@pytest.fixture
def nri_daemon(make_daemon: Any, short_tmp: Path, busybox_layout: Path) -> Daemon:
    return nri_daemon_with(make_daemon, short_tmp, busybox_layout)


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


def test_a_plugin_updates_a_running_containers_memory_limit_within_the_cap(
    nri_daemon: Daemon, plugin: RecordingPlugin, short_tmp: Path
) -> None:
    with pod(nri_daemon, "updated", short_tmp) as p:
        container_id = create(nri_daemon, p, container_config("long", "sleep 60"))
        start(nri_daemon, container_id)
        before = exec_sync(nri_daemon, container_id, ["sh", "-c", MEMORY_LIMIT]).stdout
        update = nri.ContainerUpdate(container_id=container_id)
        update.linux.resources.memory.limit.value = 2 * LIMIT
        # Over the cap: refused whole, nothing of it applied.
        with pytest.raises(CallError) as refused:
            plugin_call(plugin, plugin.update_containers([update] * (MAX_UPDATES + 1)))
        assert refused.value.code == Code.RESOURCE_EXHAUSTED
        assert f"{MAX_UPDATES + 1} container updates in one request" in refused.value.message
        assert f"at most {MAX_UPDATES}" in refused.value.message
        assert exec_sync(nri_daemon, container_id, ["sh", "-c", MEMORY_LIMIT]).stdout == before
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
    daemon = nri_daemon_with(
        make_daemon,
        short_tmp,
        busybox_layout,
        plugin_path=str(plugins),
        plugin_config_path=str(configs),
    )
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


# ---- a plugin can slow one event, never the node ------------------------------------


def heavy_pod(name: str, log_dir: Path) -> api_pb2.PodSandboxConfig:
    """A pod with as many bytes of labels and of annotations as kubelet lets through
    (256 KiB each): about 500 KiB to describe."""
    notes = {f"example.com/note-{i}": "x" * 60_000 for i in range(4)}
    return pod_config(
        name, uid=f"uid-{name}", log_directory=str(log_dir / name), labels=notes, annotations=notes
    )


def test_a_plugin_that_stops_reading_is_dropped_and_the_creation_goes_on(
    nri_daemon: Daemon, short_tmp: Path
) -> None:
    thread = PluginThread(RecordingPlugin(name="wedged"), short_tmp / "nri.sock")
    plugin = thread.start()
    try:
        wait_until(lambda: "Synchronize" in plugin.methods)
        assert plugin.loop is not None
        plugin.loop.call_soon_threadsafe(plugin.stop_reading)
        # Bigger than the socket's buffers: the daemon cannot even send this RunPodSandbox.
        config = heavy_pod("heavy", short_tmp)
        sandbox_id = (
            nri_daemon.runtime()
            .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=30)
            .pod_sandbox_id
        )
        # Dropped once its budget (sending included) was spent, whatever the socket's
        # buffers took of the request.
        assert "NRI: plugin 10-wedged dropped: DEADLINE_EXCEEDED" in nri_daemon.log()
        # And the next pod is not held behind it.
        with pod(nri_daemon, "next", short_tmp):
            pass
        remove_pod(nri_daemon, sandbox_id)
    finally:
        thread.stop()
    assert nri_daemon.leaks() == {}


def test_state_over_one_message_is_synchronized_split_and_an_oversized_event_refused(
    make_daemon: Any, short_tmp: Path, busybox_layout: Path
) -> None:
    daemon = nri_daemon_with(make_daemon, short_tmp, busybox_layout)
    pods = []
    try:
        for i in range(10):  # about 10 x 500 KiB: more than the 4 MiB of one message
            pods.append(run_pod(daemon, heavy_pod(f"heavy-{i}", short_tmp)))
        thread = PluginThread(RecordingPlugin(name="late"), short_tmp / "nri.sock")
        plugin = thread.start()
        try:
            wait_until(lambda: _registered_as(daemon, plugin))
            syncs = [r for m, r in plugin.calls if m == "Synchronize"]
            assert len(syncs) > 1
            assert [s.more for s in syncs] == [True] * (len(syncs) - 1) + [False]
            assert sorted(plugin.told("pod")) == sorted(pods)

            # A container whose description is over a message (its environment alone):
            # refused, naming the plugin and the size.
            envs = [api_pb2.KeyValue(key=f"V{i}", value=b"x" * 100_000) for i in range(50)]
            big = container_config("huge", "true", envs=envs)
            with pytest.raises(grpc.RpcError) as err:
                create(daemon, (pods[0], heavy_pod("heavy-0", short_tmp)), big)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = err.value.details()
            assert "NRI plugin 10-late: CreateContainer request of" in details
            assert "over the 4194304-byte limit of a message" in details
            assert "CreateContainer" not in plugin.methods
            assert not daemon.rows("containers")
        finally:
            thread.stop()
    finally:
        for sandbox_id in pods:
            remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


def test_plugins_being_admitted_hold_no_creation_and_miss_no_container(
    make_daemon: Any, short_tmp: Path, busybox_layout: Path
) -> None:
    # A budget far longer than the test: only the plugins' answers end their Synchronize.
    daemon = nri_daemon_with(
        make_daemon, short_tmp, busybox_layout, plugin_registration_timeout="60s"
    )
    socket = short_tmp / "nri.sock"
    with pod(daemon, "admitted", short_tmp) as p:
        before = create(daemon, p, container_config("before", "sleep 60"))
        release = threading.Event()
        threads = [
            PluginThread(
                RecordingPlugin(name=f"joining-{i}", holds={"Synchronize": release}), socket
            )
            for i in range(3)
        ]
        try:
            plugins = [thread.start() for thread in threads]
            wait_until(lambda: all("Synchronize" in plugin.methods for plugin in plugins))
            # Every plugin holds its Synchronize: a pod and containers are made all the same.
            during = [
                create(daemon, p, container_config(f"during-{i}", "sleep 60")) for i in range(3)
            ]
            with pod(daemon, "unrelated", short_tmp) as other:
                assert all(plugin.methods == ["Configure", "Synchronize"] for plugin in plugins)
                release.set()
                wait_until(lambda: all(_registered_as(daemon, plugin) for plugin in plugins))
                after = create(daemon, p, container_config("after", "sleep 60"))
                wait_until(lambda: all(after in plugin.told() for plugin in plugins))
                for plugin in plugins:
                    # Each container and pod reached each plugin once, by one way or the other.
                    assert sorted(plugin.told()) == sorted([before, *during, after])
                    assert sorted(plugin.told("pod")) == sorted([p[0], other[0]])
                    # What came while it synchronized came after its Synchronize, in order.
                    created = [c for c in plugin.told() if c in during]
                    assert created == during
                for container_id in [before, *during, after]:
                    remove(daemon, container_id)
        finally:
            release.set()
            for thread in threads:
                thread.stop()
    assert daemon.leaks() == {}


def _registered_as(daemon: Daemon, plugin: RecordingPlugin) -> bool:
    return f"NRI: plugin {plugin.index}-{plugin.name} registered" in daemon.log()


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def test_a_method_nobody_serves_is_refused_without_its_name(
    nri_daemon: Daemon, plugin: RecordingPlugin
) -> None:
    wait_until(lambda: _registered_as(nri_daemon, plugin))
    assert plugin.connection is not None
    # Named with a megabyte: the answer does not carry it back.
    with pytest.raises(CallError) as unknown:
        plugin_call(
            plugin,
            plugin.connection.call(RUNTIME_SERVICE, "x" * (1 << 20), nri.Empty(), nri.Empty(), 10),
        )
    assert unknown.value.code == Code.UNIMPLEMENTED
    assert len(unknown.value.message) < 100


def test_a_peer_that_sends_and_never_reads_cannot_grow_the_daemon(
    nri_daemon: Daemon, short_tmp: Path
) -> None:
    assert nri_daemon.proc is not None
    thread = PluginThread(RecordingPlugin(name="flood"), short_tmp / "nri.sock")
    plugin = thread.start()
    try:
        wait_until(lambda: _registered_as(nri_daemon, plugin))
        assert plugin.loop is not None
        before = rss_kib(nri_daemon.proc.pid)
        # 64 MiB of requests, and not one answer read.
        envelope = ttrpc_pb2.Request(service=RUNTIME_SERVICE, method="Nothing").SerializeToString()
        flood = b"".join(
            mux.encode(
                mux.RUNTIME_SERVICE_CONN,
                ttrpc.encode_message(stream_id, ttrpc.MessageType.REQUEST, envelope),
            )
            for stream_id in range(1, 2 * 100_000, 2)
        )
        writer = plugin._writer
        assert writer is not None

        def write_flood() -> None:
            plugin.stop_reading()
            for _ in range((64 << 20) // len(flood)):
                writer.write(flood)

        plugin.loop.call_soon_threadsafe(write_flood)
        held: list[int] = []

        def settled() -> bool:
            held.append(writer.transport.get_write_buffer_size())
            return len(held) > 20 and len(set(held[-20:])) == 1

        wait_until(settled, timeout=120)
        # The daemon stopped reading: what it would have had to answer waits in the peer.
        assert held[-1] > 32 << 20
        assert rss_kib(nri_daemon.proc.pid) - before < 32 << 10
    finally:
        thread.stop()


def test_a_plugin_configuration_that_is_not_a_regular_file_is_refused(
    make_daemon: Any, short_tmp: Path
) -> None:
    plugins, configs, out = short_tmp / "plugins", short_tmp / "conf.d", short_tmp / "out"
    for directory in (plugins, configs, out):
        directory.mkdir()
    for name in ("20-piped", "30-huge", "40-fine"):
        script = plugins / name
        script.write_text(f"#!/bin/sh\ntouch {out}/{name}\nexec sleep 60\n")
        script.chmod(0o755)
    os.mkfifo(configs / "20-piped.conf")  # opened for reading, it would wait for a writer
    (configs / "30-huge.conf").write_bytes(b"x" * (2 << 20))
    (configs / "40-fine.conf").write_text("fine")
    # Serving: the FIFO held nothing up.
    daemon = nri_daemon_with(
        make_daemon, short_tmp, plugin_path=str(plugins), plugin_config_path=str(configs)
    )
    wait_until(lambda: (out / "40-fine").exists())
    log = daemon.log()
    assert f"not starting plugin {plugins}/20-piped: its configuration: " in log
    assert f"{configs}/20-piped.conf is not a regular file" in log
    assert f"{configs}/30-huge.conf is larger than 1048576 bytes" in log
    assert not (out / "20-piped").exists() and not (out / "30-huge").exists()


def test_with_the_default_budgets_a_plugin_may_take_longer_to_synchronize_than_an_event(
    nri_daemon: Daemon, short_tmp: Path
) -> None:
    # critest's joining plugin holds its Synchronize for 2 s, one event's whole budget.
    with pod(nri_daemon, "synced", short_tmp) as p:
        before = create(nri_daemon, p, container_config("before", "sleep 60"))
        thread = PluginThread(
            RecordingPlugin(name="slow-sync", delays={"Synchronize": 3.0}),
            short_tmp / "nri.sock",
        )
        plugin = thread.start()
        try:
            during = create(nri_daemon, p, container_config("during", "sleep 60"))
            wait_until(lambda: _registered_as(nri_daemon, plugin), timeout=15)
            after = create(nri_daemon, p, container_config("after", "sleep 60"))
            wait_until(lambda: after in plugin.told())
            assert sorted(plugin.told()) == sorted([before, during, after])
            for container_id in (before, during, after):
                remove(nri_daemon, container_id)
        finally:
            thread.stop()
    assert nri_daemon.leaks() == {}


def removed_told(plugin: RecordingPlugin, kind: str = "container") -> set[str]:
    """The IDs of the containers (or pods) it heard the removal of."""
    removal = nri.RemoveContainerRequest if kind == "container" else nri.RemovePodSandboxRequest
    return {
        getattr(request, kind).id for _, request in plugin.calls if isinstance(request, removal)
    }


@pytest.mark.parametrize("kind", ["container", "pod"])
def test_a_plugin_that_joins_during_a_removal_is_told_of_every_object_it_synchronized_with(
    make_daemon: Any, short_tmp: Path, busybox_layout: Path, kind: str
) -> None:
    """A RemoveContainer or RemovePodSandbox that has picked its plugins and waits for
    the first one's answer (the pod is still listed meanwhile): a plugin that joins then
    is told of the object's removal, or is not synchronized with it."""
    # Budgets longer than the test: only the first plugin's answer ends the removal.
    daemon = nri_daemon_with(make_daemon, short_tmp, busybox_layout, plugin_request_timeout="60s")
    socket = short_tmp / "nri.sock"
    release = threading.Event()
    held = "RemoveContainer" if kind == "container" else "RemovePodSandbox"
    first = PluginThread(RecordingPlugin(name="first", holds={held: release}), socket)
    late = PluginThread(RecordingPlugin(name="late", index="20"), socket)
    try:
        holding = first.start()
        with pod(daemon, "removing", short_tmp) as p:
            if kind == "container":
                removed = create(daemon, p, container_config("gone", "sleep 60"))
                removal = threading.Thread(target=remove, args=(daemon, removed))
            else:
                removed = p[0]
                removal = threading.Thread(target=remove_pod, args=(daemon, removed))
            removal.start()
            wait_until(lambda: removed in removed_told(holding, kind))
            joined = late.start()
            wait_until(lambda: _registered_as(daemon, joined))
            release.set()
            removal.join(timeout=30)
            assert not removal.is_alive()
            # What it was synchronized with, it hears the end of.
            synchronized = set(joined.told(kind))
            wait_until(lambda: synchronized <= removed_told(joined, kind), timeout=5)
    finally:
        release.set()
        first.stop()
        late.stop()
    assert daemon.leaks() == {}
