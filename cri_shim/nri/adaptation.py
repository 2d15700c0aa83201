"""The runtime's side of NRI: the socket plugins connect to, and the registry of plugins.

A plugin that connects registers (name, two-digit index) within the registration timeout,
is configured (it answers with the events it subscribes to), and is synchronized with the
pods and containers that exist at that moment; only then does it take part in events.
Plugins see events in the order of their index (then name). Every call has the request
timeout as its budget: a plugin that does not answer in time, or whose connection drops,
is closed and leaves the registry, so that no creation waits on it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import Message as ProtoMessage

from cri_shim.nri import mux
from cri_shim.nri.adjust import oci_resources, unsupported_resources
from cri_shim.nri.api import api_pb2
from cri_shim.nri.connection import ConnectionClosed, Handler, MuxedConnection
from cri_shim.nri.ttrpc import CallError, Code

log = logging.getLogger("cri_shim.nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
# An event's bit in a plugin's subscription is 1 << (event - 1).
ALL_EVENTS = (1 << (api_pb2.LAST - 1)) - 1
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_INDEX = re.compile(r"[0-9]{2}")

Reply = TypeVar("Reply", bound=ProtoMessage)
# A plugin's container update: the container ID and the OCI LinuxResources to apply.
UpdateResources = Callable[[str, dict[str, Any]], Awaitable[None]]
Snapshot = Callable[[], Awaitable[tuple[list[api_pb2.PodSandbox], list[api_pb2.Container]]]]


def event_bit(event: int) -> int:
    return 1 << (event - 1)


@dataclass(frozen=True)
class NriSettings:
    socket_path: Path = Path("/var/run/nri/nri.sock")
    registration_timeout: float = 5.0
    request_timeout: float = 2.0
    runtime_name: str = "cri-shim"
    runtime_version: str = ""
    plugin_path: Path | None = None
    plugin_config_path: Path | None = None


@dataclass
class Plugin:
    """A registered, configured and synchronized plugin."""

    name: str
    index: str
    events: int
    connection: MuxedConnection = field(repr=False)

    @property
    def id(self) -> str:
        return f"{self.index}-{self.name}"

    def subscribed(self, event: int) -> bool:
        return bool(self.events & event_bit(event))


class PluginRejected(Exception):
    """A connecting plugin failed registration, configuration or synchronization."""


class Adaptation:
    def __init__(
        self, settings: NriSettings, snapshot: Snapshot, update: UpdateResources | None = None
    ) -> None:
        self.settings = settings
        self._snapshot = snapshot
        self._update = update
        self._plugins: list[Plugin] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._launched: list[LaunchedPlugin] = []
        # Registration and synchronization take this lock, and so does every event, so a
        # plugin never misses an object created while it synchronizes, nor sees one twice.
        self.lock = asyncio.Lock()

    @property
    def plugins(self) -> list[Plugin]:
        """The plugins taking part in events, in the order they see them."""
        return list(self._plugins)

    async def start(self) -> None:
        path = self.settings.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._server = await asyncio.start_unix_server(self._on_connect, path=str(path))
        os.chmod(path, 0o600)
        log.info("NRI: serving plugins on %s", path)
        if self.settings.plugin_path is not None:
            for executable, index, name in pre_installed_plugins(self.settings.plugin_path):
                await self._launch(executable, index, name)

    async def _launch(self, executable: Path, index: str, name: str) -> None:
        try:
            config = plugin_config(self.settings.plugin_config_path, index, name)
        except OSError as e:
            log.warning("NRI: not starting plugin %s: its configuration: %s", executable, e)
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Only these, as containerd gives its plugins: the daemon's own environment
            # is none of a plugin's business.
            env = {
                "NRI_PLUGIN_NAME": name,
                "NRI_PLUGIN_IDX": index,
                "NRI_PLUGIN_SOCKET": str(theirs.fileno()),
            }
            try:
                process = await asyncio.create_subprocess_exec(
                    str(executable),
                    env=env,
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as e:
                ours.close()
                log.warning("NRI: cannot start plugin %s: %s", executable, e)
                return
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        launched = LaunchedPlugin(f"{index}-{name}", process)
        self._launched.append(launched)
        log.info("NRI: started plugin %s (pid %d)", launched.id, process.pid)
        self._own(self._serve_plugin(reader, writer, config, (name, index)))
        self._own(self._watch(launched))

    def _own(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, launched: LaunchedPlugin) -> None:
        code = await launched.process.wait()
        if not launched.stopping:
            log.warning("NRI: plugin %s exited with status %d", launched.id, code)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        # Every plugin hears it, subscribed or not, all at once: the daemon's stop waits
        # one request budget for them, not one per plugin.
        await asyncio.gather(*(self._shut_down(plugin) for plugin in list(self._plugins)))
        for plugin in list(self._plugins):
            await self._drop(plugin, "the runtime is stopping")
        for launched in self._launched:
            await launched.stop(self.settings.request_timeout)
        self._launched.clear()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.settings.socket_path.unlink()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve_plugin(reader, writer)
        except asyncio.CancelledError:
            # Only stop() cancels these: the connection ends with the runtime, and the
            # stream machinery would otherwise report the cancellation as an error.
            pass
        finally:
            self._tasks.discard(task)

    async def _serve_plugin(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        config: str = "",
        launched_as: tuple[str, str] | None = None,
    ) -> None:
        """Serve one plugin connection; a launched plugin is known by the (name, index) of
        its file, whatever it registers as, as in containerd."""
        registered: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()

        async def register(payload: bytes) -> bytes:
            request = api_pb2.RegisterPluginRequest.FromString(payload)
            if launched_as is not None:
                if not registered.done():
                    registered.set_result(launched_as)
                return api_pb2.Empty().SerializeToString()
            problem = _registration_problem(request)
            if problem:
                if not registered.done():
                    registered.set_exception(PluginRejected(problem))
                raise CallError(Code.INVALID_ARGUMENT, problem)
            if not registered.done():
                registered.set_result((request.plugin_name, request.plugin_idx))
            return api_pb2.Empty().SerializeToString()

        plugin: Plugin | None = None

        async def update_containers(payload: bytes) -> bytes:
            request = api_pb2.UpdateContainersRequest.FromString(payload)
            failed = await self._on_update_request(plugin, request)
            return api_pb2.UpdateContainersResponse(failed=failed).SerializeToString()

        handlers: dict[str, Handler] = {
            f"{RUNTIME_SERVICE}/RegisterPlugin": register,
            f"{RUNTIME_SERVICE}/UpdateContainers": update_containers,
        }
        connection = MuxedConnection(
            reader,
            writer,
            serve_conn=mux.RUNTIME_SERVICE_CONN,
            call_conn=mux.PLUGIN_SERVICE_CONN,
            handlers=handlers,
        )
        reading = asyncio.get_running_loop().create_task(connection.run())
        try:
            try:
                plugin = await self._admit(connection, registered, config)
            except (PluginRejected, CallError, ConnectionClosed, TimeoutError) as e:
                log.warning("NRI: plugin %s refused: %s", connection.name, e)
                await connection.close(f"refused: {e}")
                return
            await reading
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            if plugin is not None and plugin in self._plugins:
                self._plugins.remove(plugin)
                log.info("NRI: plugin %s left: %s", plugin.id, connection.close_reason)

    async def _admit(
        self,
        connection: MuxedConnection,
        registered: asyncio.Future[tuple[str, str]],
        config: str,
    ) -> Plugin:
        closed = asyncio.ensure_future(connection.closed.wait())
        either: set[asyncio.Future[Any]] = {registered, closed}
        try:
            done, _ = await asyncio.wait(
                either,
                timeout=self.settings.registration_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            closed.cancel()
        if registered not in done:
            raise PluginRejected(
                "connection closed before registering"
                if connection.closed.is_set()
                else f"did not register in {self.settings.registration_timeout:g}s"
            )
        name, index = registered.result()
        connection.name = f"{index}-{name}"
        timeout = self.settings.request_timeout
        configured = await connection.call(
            PLUGIN_SERVICE,
            "Configure",
            api_pb2.ConfigureRequest(
                runtime_name=self.settings.runtime_name,
                runtime_version=self.settings.runtime_version,
                registration_timeout=int(self.settings.registration_timeout * 1000),
                request_timeout=int(timeout * 1000),
                config=config,
            ),
            api_pb2.ConfigureResponse(),
            timeout,
        )
        events = configured.events or ALL_EVENTS
        if events & ~ALL_EVENTS:
            raise PluginRejected(f"subscribes to unknown events 0x{events & ~ALL_EVENTS:x}")
        async with self.lock:
            pods, containers = await self._snapshot()
            synchronized = await connection.call(
                PLUGIN_SERVICE,
                "Synchronize",
                api_pb2.SynchronizeRequest(pods=pods, containers=containers),
                api_pb2.SynchronizeResponse(),
                timeout,
            )
            plugin = Plugin(name, index, events, connection)
            if synchronized.update:
                await self.apply_updates(plugin, list(synchronized.update))
            self._plugins.append(plugin)
            self._plugins.sort(key=lambda p: (p.index, p.name))
        log.info("NRI: plugin %s registered, events 0x%x", plugin.id, events)
        return plugin

    async def _on_update_request(
        self, plugin: Plugin | None, request: api_pb2.UpdateContainersRequest
    ) -> list[api_pb2.ContainerUpdate]:
        if plugin is None:
            raise CallError(Code.FAILED_PRECONDITION, "plugin is not registered yet")
        return await self.apply_updates(plugin, list(request.update))

    async def apply_updates(
        self, plugin: Plugin, updates: list[api_pb2.ContainerUpdate]
    ) -> list[api_pb2.ContainerUpdate]:
        """Container updates a plugin asked for (resources only), applied in order;
        returns those that failed and did not say their failure may be ignored."""
        failed: list[api_pb2.ContainerUpdate] = []
        for update in updates:
            unsupported = unsupported_resources(update.linux.resources)
            try:
                if unsupported:
                    raise CallError(Code.INVALID_ARGUMENT, f"cannot apply {', '.join(unsupported)}")
                if self._update is None:
                    raise CallError(Code.UNIMPLEMENTED, "the runtime applies no updates")
                await self._update(update.container_id, oci_resources(update.linux.resources))
                log.info("NRI: plugin %s updated container %s", plugin.id, update.container_id)
            except Exception as e:
                log.warning(
                    "NRI: plugin %s: update of container %s failed: %s",
                    plugin.id,
                    update.container_id,
                    e,
                )
                if not update.ignore_failure:
                    failed.append(update)
        return failed

    async def _shut_down(self, plugin: Plugin) -> None:
        try:
            await plugin.connection.call(
                PLUGIN_SERVICE,
                "Shutdown",
                api_pb2.Empty(),
                api_pb2.Empty(),
                self.settings.request_timeout,
            )
        except (CallError, ConnectionClosed) as e:
            log.warning("NRI: plugin %s: shutdown: %s", plugin.id, e)

    async def _drop(self, plugin: Plugin, reason: str) -> None:
        if plugin in self._plugins:
            self._plugins.remove(plugin)
        log.warning("NRI: plugin %s dropped: %s", plugin.id, reason)
        await plugin.connection.close(reason)

    async def call_plugins(
        self, event: int, method: str, request: ProtoMessage, reply: Callable[[], Reply]
    ) -> list[tuple[Plugin, Reply]]:
        """Send one event to every subscribed plugin in order; their answers.

        A plugin that times out or disconnects is dropped and the event goes on to the
        next; a plugin that answers with an error status fails the event (CallError).
        """
        answers: list[tuple[Plugin, Reply]] = []
        for plugin in list(self._plugins):
            if not plugin.subscribed(event):
                continue
            try:
                answer = await plugin.connection.call(
                    PLUGIN_SERVICE, method, request, reply(), self.settings.request_timeout
                )
            except ConnectionClosed as e:
                await self._drop(plugin, str(e))
                continue
            except CallError as e:
                if e.code == Code.DEADLINE_EXCEEDED:
                    await self._drop(plugin, str(e))
                    continue
                raise CallError(e.code, f"NRI plugin {plugin.id}: {e.message}") from e
            answers.append((plugin, answer))
        return answers


@dataclass
class LaunchedPlugin:
    """A pre-installed plugin's process, started and owned by the daemon."""

    id: str
    process: asyncio.subprocess.Process = field(repr=False)
    stopping: bool = False

    async def stop(self, grace: float) -> None:
        """Terminate the process, killed if it outlives `grace`, and reap it."""
        self.stopping = True
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                async with asyncio.timeout(grace):
                    await self.process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()


_PLUGIN_FILE = re.compile(r"([0-9]{2})-([A-Za-z0-9_.+-]+)")


def pre_installed_plugins(directory: Path) -> list[tuple[Path, str, str]]:
    """The executables named NN-name in `directory`, in name order, as (path, index, name);
    other executables are skipped with a warning, and a missing directory has none."""
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    found: list[tuple[Path, str, str]] = []
    for entry in entries:
        if not entry.is_file() or not os.access(entry, os.X_OK):
            continue  # configuration, documentation: not plugins, as in containerd
        match = _PLUGIN_FILE.fullmatch(entry.name)
        if match is None:
            # containerd refuses to start NRI at all here; one plugin's name is not worth
            # the others, nor the daemon.
            log.warning("NRI: not starting %s: a plugin is named NN-name", entry)
        else:
            found.append((entry, match[1], match[2]))
    return found


def plugin_config(directory: Path | None, index: str, name: str) -> str:
    """A pre-installed plugin's configuration: NN-name.conf, else name.conf, else none."""
    if directory is None:
        return ""
    for candidate in (f"{index}-{name}.conf", f"{name}.conf"):
        with contextlib.suppress(FileNotFoundError):
            return (directory / candidate).read_text()
    return ""


def _registration_problem(request: api_pb2.RegisterPluginRequest) -> str:
    if not _NAME.fullmatch(request.plugin_name):
        return f"invalid plugin name {request.plugin_name!r}"
    if not _INDEX.fullmatch(request.plugin_idx):
        return f"invalid plugin index {request.plugin_idx!r}, must be 2 digits"
    return ""
