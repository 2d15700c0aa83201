"""The runtime's NRI socket with real plugins connected over it: registration,
configuration, synchronization, event order by index, and plugins that fail, stall or
leave."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_shim.errors import NotFound
from cri_shim.nri.adaptation import (
    MAX_CONFIG,
    MAX_UPDATES,
    Adaptation,
    NriSettings,
    PluginConfigRefused,
    PluginRejected,
    plugin_config,
    pre_installed_plugins,
    synchronize_requests,
)
from cri_shim.nri.api import api_pb2
from cri_shim.nri.ttrpc import MAX_STREAM_ID, CallError, Code
from tests.nri_plugin import RecordingPlugin, fail_with
from tests.waiting import until

POD = api_pb2.PodSandbox(id="pod1", name="web", namespace="default", uid="u1")
CONTAINER = api_pb2.Container(
    id="c1", pod_sandbox_id="pod1", name="app", state=api_pb2.CONTAINER_RUNNING
)


class World:
    def __init__(self) -> None:
        self.pods = [POD]
        self.containers = [CONTAINER]

    async def snapshot(self) -> tuple[list[api_pb2.PodSandbox], list[api_pb2.Container]]:
        return list(self.pods), list(self.containers)


UPDATED: list[tuple[str, dict[str, object]]] = []


async def record_update(container_id: str, resources: dict[str, object]) -> None:
    if container_id == "gone":
        raise NotFound("no such container")
    UPDATED.append((container_id, resources))


@pytest.fixture
async def adaptation() -> AsyncIterator[Adaptation]:
    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        settings = NriSettings(
            socket_path=Path(tmp) / "nri.sock",
            registration_timeout=1.0,
            request_timeout=1.0,
            runtime_version="1.2.3",
        )
        UPDATED.clear()
        nri = Adaptation(settings, World().snapshot, record_update)
        await nri.start()
        try:
            yield nri
        finally:
            await nri.stop()


async def joined(nri: Adaptation, plugin: RecordingPlugin) -> RecordingPlugin:
    await plugin.connect(nri.settings.socket_path)
    await until(lambda: any(p.id == f"{plugin.index}-{plugin.name}" for p in nri.plugins))
    return plugin


async def test_a_plugin_is_configured_then_synchronized(adaptation: Adaptation) -> None:
    plugin = await joined(adaptation, RecordingPlugin(events=[api_pb2.RUN_POD_SANDBOX]))
    assert plugin.methods == ["Configure", "Synchronize"]
    configure = plugin.calls[0][1]
    assert isinstance(configure, api_pb2.ConfigureRequest)
    assert (configure.runtime_name, configure.runtime_version) == ("cri-shim", "1.2.3")
    assert (configure.registration_timeout, configure.request_timeout) == (1000, 1000)
    sync = plugin.calls[1][1]
    assert isinstance(sync, api_pb2.SynchronizeRequest)
    assert list(sync.pods) == [POD] and list(sync.containers) == [CONTAINER]
    [registered] = adaptation.plugins
    assert registered.subscribed(api_pb2.RUN_POD_SANDBOX)
    assert not registered.subscribed(api_pb2.CREATE_CONTAINER)
    await plugin.close()
    await until(lambda: not adaptation.plugins)


async def test_no_subscription_means_every_event(adaptation: Adaptation) -> None:
    await joined(adaptation, RecordingPlugin())
    [registered] = adaptation.plugins
    assert all(registered.subscribed(e) for e in range(1, api_pb2.LAST))


async def test_events_reach_plugins_in_index_order(adaptation: Adaptation) -> None:
    order: list[str] = []

    def note(name: str) -> RecordingPlugin:
        def respond(_request: object) -> api_pb2.RunPodSandboxResponse:
            order.append(name)
            return api_pb2.RunPodSandboxResponse()

        return RecordingPlugin(name=name, index=name[:2], responders={"RunPodSandbox": respond})

    # Held, as a plugin process holds its connection: an unreferenced one is collected.
    plugins = [await joined(adaptation, note(name)) for name in ("50-b", "05-a", "50-a")]
    assert [p.id for p in adaptation.plugins] == ["05-05-a", "50-50-a", "50-50-b"]
    request = api_pb2.RunPodSandboxRequest(pod=POD)
    await adaptation.call_plugins(
        api_pb2.RUN_POD_SANDBOX, "RunPodSandbox", request, api_pb2.RunPodSandboxResponse
    )
    assert order == ["05-a", "50-a", "50-b"]
    assert len(plugins) == 3


async def test_a_plugin_that_fails_an_event_fails_it(adaptation: Adaptation) -> None:
    await joined(adaptation, RecordingPlugin(responders={"CreateContainer": fail_with("no way")}))
    with pytest.raises(CallError, match="NRI plugin 10-recorder: no way"):
        await adaptation.call_plugins(
            api_pb2.CREATE_CONTAINER,
            "CreateContainer",
            api_pb2.CreateContainerRequest(pod=POD, container=CONTAINER),
            api_pb2.CreateContainerResponse,
        )
    assert len(adaptation.plugins) == 1  # a refusal is an answer: the plugin stays


async def test_a_plugin_that_stalls_is_dropped_within_its_budget(adaptation: Adaptation) -> None:
    slow = await joined(adaptation, RecordingPlugin(name="slow", delays={"StopPodSandbox": 30}))
    fast = await joined(adaptation, RecordingPlugin(name="fast", index="20"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await adaptation.call_plugins(
        api_pb2.STOP_POD_SANDBOX,
        "StopPodSandbox",
        api_pb2.StopPodSandboxRequest(pod=POD),
        api_pb2.StopPodSandboxResponse,
    )
    assert loop.time() - started < 10  # the stalled plugin's 1s budget, not its 30s
    assert [p.name for p, _ in answers] == ["fast"]
    assert [p.name for p in adaptation.plugins] == ["fast"]
    assert "StopPodSandbox" in fast.methods
    await until(lambda: slow.connection is not None and slow.connection.closed.is_set())


async def test_a_plugin_that_leaves_is_skipped(adaptation: Adaptation) -> None:
    gone = await joined(adaptation, RecordingPlugin(name="gone"))
    await gone.close()
    await until(lambda: not adaptation.plugins)
    answers = await adaptation.call_plugins(
        api_pb2.REMOVE_POD_SANDBOX,
        "RemovePodSandbox",
        api_pb2.RemovePodSandboxRequest(pod=POD),
        api_pb2.RemovePodSandboxResponse,
    )
    assert answers == []


@pytest.mark.parametrize(
    ("name", "index", "problem"),
    [("", "10", "invalid plugin name"), ("a b", "10", "invalid plugin name"),
     ("ok", "1", "must be 2 digits"), ("ok", "x1", "must be 2 digits")],
)  # fmt: skip
async def test_a_bad_registration_is_refused(
    adaptation: Adaptation, name: str, index: str, problem: str
) -> None:
    plugin = RecordingPlugin(name=name, index=index)
    with pytest.raises(CallError, match=problem) as refused:
        await plugin.connect(adaptation.settings.socket_path)
    assert refused.value.code == Code.INVALID_ARGUMENT
    assert plugin.connection is not None
    await until(plugin.connection.closed.is_set)
    assert adaptation.plugins == []


async def test_a_plugin_that_never_registers_is_closed(adaptation: Adaptation) -> None:
    plugin = RecordingPlugin()
    await plugin.connect(adaptation.settings.socket_path, register=False)
    assert plugin.connection is not None
    await until(plugin.connection.closed.is_set)
    assert plugin.methods == [] and adaptation.plugins == []


async def test_a_plugin_that_stalls_configuration_is_refused(adaptation: Adaptation) -> None:
    plugin = RecordingPlugin(delays={"Configure": 30})
    await plugin.connect(adaptation.settings.socket_path)
    assert plugin.connection is not None
    await until(plugin.connection.closed.is_set)
    assert adaptation.plugins == []


async def test_a_plugin_asking_for_unknown_events_is_refused(adaptation: Adaptation) -> None:
    plugin = RecordingPlugin(events=[api_pb2.LAST + 3])
    await plugin.connect(adaptation.settings.socket_path)
    assert plugin.connection is not None
    await until(plugin.connection.closed.is_set)
    assert plugin.methods == ["Configure"] and adaptation.plugins == []


async def test_an_unknown_method_answers_unimplemented(adaptation: Adaptation) -> None:
    plugin = await joined(adaptation, RecordingPlugin())
    assert plugin.connection is not None
    with pytest.raises(CallError) as failed:
        await plugin.connection.call(
            "nri.pkg.api.v1alpha1.Runtime", "Nope", api_pb2.Empty(), api_pb2.Empty(), 1.0
        )
    assert failed.value.code == Code.UNIMPLEMENTED


async def test_a_plugin_updates_containers_and_hears_which_failed(adaptation: Adaptation) -> None:
    plugin = await joined(adaptation, RecordingPlugin())
    memory = api_pb2.ContainerUpdate(container_id="c1")
    memory.linux.resources.memory.limit.value = 1 << 30
    missing = api_pb2.ContainerUpdate(container_id="gone")
    missing.linux.resources.cpu.shares.value = 5
    tolerated = api_pb2.ContainerUpdate(container_id="gone", ignore_failure=True)
    tolerated.linux.resources.pids.limit = 7
    unsupported = api_pb2.ContainerUpdate(container_id="c1")
    unsupported.linux.resources.hugepage_limits.add(page_size="2MB", limit=1)
    answer = await plugin.update_containers([memory, missing, tolerated, unsupported])
    assert list(answer.failed) == [missing, unsupported]
    assert UPDATED == [("c1", {"memory": {"limit": 1 << 30}})]


def test_pre_installed_plugins_are_the_executables_named_nn_name(tmp_path: Path) -> None:
    for name, mode in [
        ("10-first", 0o755),
        ("05-earlier", 0o755),
        ("20-not-executable", 0o644),
        ("1-bad-index", 0o755),
        ("noindex", 0o755),
    ]:
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(mode)
    (tmp_path / "30-dir").mkdir()
    assert pre_installed_plugins(tmp_path) == [
        (tmp_path / "05-earlier", "05", "earlier"),
        (tmp_path / "10-first", "10", "first"),
    ]
    assert pre_installed_plugins(tmp_path / "missing") == []


def test_a_pre_installed_plugins_config_is_nn_name_conf_else_name_conf(tmp_path: Path) -> None:
    (tmp_path / "logger.conf").write_text("shared")
    assert plugin_config(tmp_path, "10", "logger") == "shared"
    (tmp_path / "10-logger.conf").write_text("own")
    assert plugin_config(tmp_path, "10", "logger") == "own"
    assert plugin_config(tmp_path, "10", "other") == ""
    assert plugin_config(None, "10", "logger") == ""


async def test_plugins_are_told_of_the_shutdown_within_one_request_budget() -> None:
    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        settings = NriSettings(socket_path=Path(tmp) / "nri.sock", request_timeout=0.5)
        nri = Adaptation(settings, World().snapshot)
        await nri.start()
        # Subscribed to nothing of the shutdown: it is told all the same.
        quick = await joined(nri, RecordingPlugin(name="quick", events=[api_pb2.RUN_POD_SANDBOX]))
        # Plugins that never answer: told one after the other, they would hold the stop
        # for 20 budgets (10 s); told at once, for one.
        slow = [
            await joined(nri, RecordingPlugin(name=f"slow{n}", delays={"Shutdown": 60.0}))
            for n in range(20)
        ]
        started = asyncio.get_running_loop().time()
        await nri.stop()
        assert asyncio.get_running_loop().time() - started < 5.0
        for plugin in (quick, *slow):
            assert plugin.methods[-1] == "Shutdown"
            assert plugin.connection is not None
            await plugin.connection.closed.wait()
            await plugin.close()


async def test_a_pre_installed_plugin_that_exits_is_logged_not_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runs = tmp_path / "runs"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    script = plugins / "30-quitter"
    script.write_text(f'#!/bin/sh\necho "$NRI_PLUGIN_IDX-$NRI_PLUGIN_NAME" >> {runs}\nexit 3\n')
    script.chmod(0o755)
    settings = NriSettings(
        socket_path=tmp_path / "nri.sock", registration_timeout=0.5, plugin_path=plugins
    )
    nri = Adaptation(settings, World().snapshot)
    await nri.start()
    try:
        await until(lambda: "exited with status 3" in caplog.text)
        await asyncio.sleep(0.6)  # past the registration timeout: nothing starts it again
        assert runs.read_text().splitlines() == ["30-quitter"]
        assert not nri.plugins
    finally:
        await nri.stop()


def test_synchronize_is_split_under_the_message_limit_in_order() -> None:
    pods = [api_pb2.PodSandbox(id=f"p{i}", name="x" * 300) for i in range(10)]
    containers = [api_pb2.Container(id=f"c{i}", name="y" * 300) for i in range(10)]
    requests = synchronize_requests(pods, containers, limit=1000)
    assert len(requests) > 2
    assert all(r.ByteSize() <= 1000 for r in requests)
    assert [r.more for r in requests] == [True] * (len(requests) - 1) + [False]
    assert [p for r in requests for p in r.pods] == pods
    assert [c for r in requests for c in r.containers] == containers
    [whole] = synchronize_requests(pods, containers)
    assert not whole.more and list(whole.pods) == pods


def test_an_object_too_big_for_any_message_refuses_the_synchronization() -> None:
    with pytest.raises(PluginRejected, match=r"pod p1 is described in \d+ bytes, over the"):
        synchronize_requests([api_pb2.PodSandbox(id="p1", name="x" * 2000)], [], limit=1000)


def test_a_plugin_config_is_bounded_and_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "piped.conf")
    with pytest.raises(PluginConfigRefused, match=r"piped\.conf is not a regular file"):
        plugin_config(tmp_path, "10", "piped")
    (tmp_path / "huge.conf").write_bytes(b"x" * (MAX_CONFIG + 1))
    with pytest.raises(PluginConfigRefused, match="is larger than"):
        plugin_config(tmp_path, "10", "huge")
    (tmp_path / "10-bad.conf").write_bytes(b"\xff\xfe")
    with pytest.raises(PluginConfigRefused, match="not UTF-8"):
        plugin_config(tmp_path, "10", "bad")


async def test_a_plugins_error_text_is_cut_where_the_daemon_repeats_it(
    adaptation: Adaptation,
) -> None:
    await joined(adaptation, RecordingPlugin(responders={"CreateContainer": fail_with("x" * 5000)}))
    with pytest.raises(CallError) as refused:
        await adaptation.call_plugins(
            api_pb2.CREATE_CONTAINER,
            "CreateContainer",
            api_pb2.CreateContainerRequest(pod=POD, container=CONTAINER),
            api_pb2.CreateContainerResponse,
        )
    assert refused.value.message.endswith("… (5000 characters)")
    assert len(refused.value.message) < 1100


async def test_a_connection_out_of_stream_ids_drops_its_plugin(adaptation: Adaptation) -> None:
    await joined(adaptation, RecordingPlugin())
    [registered] = adaptation.plugins
    registered.connection._calls._next = MAX_STREAM_ID + 2
    answers = await adaptation.call_plugins(
        api_pb2.STOP_POD_SANDBOX,
        "StopPodSandbox",
        api_pb2.StopPodSandboxRequest(pod=POD),
        api_pb2.StopPodSandboxResponse,
    )
    assert answers == [] and adaptation.plugins == []
    assert registered.connection.closed.is_set()


async def test_a_peer_has_at_most_32_requests_served_at_once() -> None:
    served: list[int] = []
    busy = 0
    gate = asyncio.Event()

    async def slow_update(container_id: str, resources: dict[str, object]) -> None:
        nonlocal busy
        busy += 1
        served.append(busy)
        await gate.wait()
        busy -= 1

    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        settings = NriSettings(socket_path=Path(tmp) / "nri.sock", request_timeout=1.0)
        nri = Adaptation(settings, World().snapshot, slow_update)
        await nri.start()
        try:
            plugin = await joined(nri, RecordingPlugin())
            update = api_pb2.ContainerUpdate(container_id="c1")
            update.linux.resources.pids.limit = 7
            asked = [asyncio.ensure_future(plugin.update_containers([update])) for _ in range(100)]
            await until(lambda: len(served) >= 32)
            await asyncio.sleep(0.2)  # room for any more to start: none does
            assert max(served) == 32
            gate.set()
            answers = await asyncio.gather(*asked)
            assert len(answers) == 100 and max(served) == 32
        finally:
            await nri.stop()


def big_world() -> World:
    world = World()
    world.pods = [api_pb2.PodSandbox(id=f"p{i}", name="x" * (600 << 10)) for i in range(10)]
    return world


async def split_adaptation(tmp: str, world: World) -> Adaptation:
    settings = NriSettings(
        socket_path=Path(tmp) / "nri.sock", registration_timeout=1.0, request_timeout=1.0
    )
    nri = Adaptation(settings, world.snapshot)
    await nri.start()
    return nri


async def test_a_plugin_that_cannot_take_a_split_synchronize_is_refused() -> None:
    whole = api_pb2.SynchronizeResponse()  # no `more`: it took the first part as the whole
    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        nri = await split_adaptation(tmp, big_world())
        try:
            plugin = RecordingPlugin(responders={"Synchronize": lambda _request: whole})
            await plugin.connect(nri.settings.socket_path)
            assert plugin.connection is not None
            await until(plugin.connection.closed.is_set)
            assert plugin.methods == ["Configure", "Synchronize"] and nri.plugins == []
        finally:
            await nri.stop()


async def test_a_split_synchronize_has_one_budget_for_all_its_messages() -> None:
    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        nri = await split_adaptation(tmp, big_world())
        try:
            # Each of its two messages answered in 0.6s: within the budget one by one,
            # not together.
            plugin = RecordingPlugin(delays={"Synchronize": 0.6})
            await plugin.connect(nri.settings.socket_path)
            assert plugin.connection is not None
            await until(plugin.connection.closed.is_set)
            assert "Synchronize" in plugin.methods and nri.plugins == []
        finally:
            await nri.stop()


async def test_synchronize_is_budgeted_as_registration_not_as_one_event() -> None:
    # critest holds a joining plugin's Synchronize for 2 s: longer than an event may take,
    # well within what a plugin has to register.
    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        settings = NriSettings(
            socket_path=Path(tmp) / "nri.sock", registration_timeout=2.0, request_timeout=0.5
        )
        nri = Adaptation(settings, World().snapshot)
        await nri.start()
        try:
            plugin = await joined(nri, RecordingPlugin(delays={"Synchronize": 1.0}))
            assert [p.name for p in nri.plugins] == [plugin.name]
            late = RecordingPlugin(name="late", delays={"Synchronize": 3.0})
            await late.connect(nri.settings.socket_path)
            assert late.connection is not None
            await until(late.connection.closed.is_set, 5.0)
            assert [p.name for p in nri.plugins] == [plugin.name]
            await plugin.close()
        finally:
            await nri.stop()


async def test_a_synchronize_answer_with_more_updates_than_the_cap_refuses_the_plugin() -> None:
    applied: list[str] = []

    async def update(container_id: str, _resources: dict[str, object]) -> None:
        applied.append(container_id)

    many = api_pb2.SynchronizeResponse(
        update=[api_pb2.ContainerUpdate(container_id="c1")] * (MAX_UPDATES + 1)
    )
    with tempfile.TemporaryDirectory(prefix="nri") as tmp:
        settings = NriSettings(socket_path=Path(tmp) / "nri.sock")
        nri = Adaptation(settings, World().snapshot, update)
        await nri.start()
        try:
            plugin = RecordingPlugin(responders={"Synchronize": lambda _request: many})
            await plugin.connect(nri.settings.socket_path)
            assert plugin.connection is not None
            await until(plugin.connection.closed.is_set)
            assert nri.plugins == [] and applied == []
            await plugin.close()
        finally:
            await nri.stop()
