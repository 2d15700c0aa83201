"""The runtime's side of NRI: the socket plugins connect to, and the registry of plugins.

A plugin that connects registers (name, two-digit index) within the registration timeout,
is configured (it answers with the events it subscribes to), and is synchronized with the
pods and containers that exist at that moment, within the registration timeout again;
only then does it take part in events. Plugins see events in the order of their index
(then name). Every other call has the request timeout as its budget, sending included: a
plugin that does not answer in time, or whose connection drops, is closed and leaves the
registry, so that no creation waits on it twice.

A plugin is enrolled in the same step as its snapshot is taken, and events pick their
plugins under the same lock, held for no plugin's answer: every object reaches a plugin
once, in its Synchronize or in an event. Events that come while a plugin synchronizes wait
for it in its backlog, and are told to it, in order, once it has answered; no event waits
for a plugin's admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import stat
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import Message as ProtoMessage

from cri_shim import tracing
from cri_shim.nri import mux, ttrpc
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
# An event told to a plugin after the fact: method, request, and its reply's type.
Told = tuple[str, ProtoMessage, Callable[[], ProtoMessage]]

# Events that may wait for a plugin while it synchronizes; a plugin that lets more pile
# up is dropped.
MAX_BACKLOG = 1024
# A pre-installed plugin's configuration file travels in one message.
MAX_CONFIG = 1 << 20
# What a plugin's own text (an error it answers with) may add to a log line or a status.
MAX_SHOWN = 1024
# Container updates one UpdateContainers request (or a Synchronize answer) may ask for.
# Each is a `runc update` (9 ms), applied one after the other: a 4 MiB request held the
# plugin's call for minutes. 256 are every container of a node at kubelet's 110 pods
# with two containers each, and more.
MAX_UPDATES = 256


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
    # Events that came while it synchronized, told once it has; None from then on.
    backlog: list[Told] | None = field(default_factory=list, repr=False)

    @property
    def id(self) -> str:
        return f"{self.index}-{self.name}"

    def subscribed(self, event: int) -> bool:
        return bool(self.events & event_bit(event))


class PluginRejected(Exception):
    """A connecting plugin failed registration, configuration or synchronization."""


class PluginConfigRefused(ValueError):
    """A pre-installed plugin's configuration file is not one the daemon reads."""


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
        # Held while a plugin's snapshot is taken and it is enrolled, and while an event
        # journals its object and picks its plugins, never for a plugin's answer: a
        # plugin never misses an object created while it synchronizes, nor sees one twice.
        self.lock = asyncio.Lock()

    @property
    def plugins(self) -> list[Plugin]:
        """The plugins synchronized and taking part in events, in the order they see them."""
        return [plugin for plugin in self._plugins if plugin.backlog is None]

    async def start(self) -> None:
        path = self.settings.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._server = await asyncio.start_unix_server(self._on_connect, path=str(path))
        os.chmod(path, 0o600)
        log.info("NRI: serving plugins on %s", path)
        if self.settings.plugin_path is not None:
            found = await asyncio.to_thread(pre_installed_plugins, self.settings.plugin_path)
            for executable, index, name in found:
                await self._launch(executable, index, name)

    async def _launch(self, executable: Path, index: str, name: str) -> None:
        try:
            # Off the loop: the directory is the operator's, and a file there may be slow.
            config = await asyncio.to_thread(
                plugin_config, self.settings.plugin_config_path, index, name
            )
        except (OSError, ValueError) as e:
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
                log.warning("NRI: plugin %s refused: %s", connection.name, shown(str(e)))
                await connection.close(f"refused: {shown(str(e))}")
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
        plugin = Plugin(name, index, events, connection)
        async with self.lock:
            # From here on every event picks this plugin (into its backlog until it has
            # synchronized), and every object told before is in the snapshot.
            pods, containers = await self._snapshot()
            self._plugins.append(plugin)
            self._plugins.sort(key=lambda p: (p.index, p.name))
        try:
            updates = await self._synchronize(plugin, pods, containers)
            if len(updates) > MAX_UPDATES:
                raise PluginRejected(f"its Synchronize answer: {_too_many_updates(len(updates))}")
        except BaseException:
            if plugin in self._plugins:
                self._plugins.remove(plugin)
            raise
        if updates:
            await self.apply_updates(plugin, updates)
        await self._catch_up(plugin)
        log.info("NRI: plugin %s registered, events 0x%x", plugin.id, events)
        return plugin

    async def _synchronize(
        self, plugin: Plugin, pods: list[api_pb2.PodSandbox], containers: list[api_pb2.Container]
    ) -> list[api_pb2.ContainerUpdate]:
        """Synchronize, in as many messages as the size limit takes (upstream NRI's split:
        every message but the last says `more`, and is answered with `more` and no
        updates), all within the registration budget; the plugin's updates.

        Synchronize is the last step of a plugin's registration, and the one that grows
        with the node (a plugin reconciles every pod and container it is told of), so it
        is budgeted as registration, not as one event: no creation waits for it (events
        go to the plugin's backlog meanwhile), so a longer budget costs nothing else."""
        budget = self.settings.registration_timeout
        requests = synchronize_requests(pods, containers)
        answer = api_pb2.SynchronizeResponse()
        try:
            async with asyncio.timeout(budget):
                for request in requests:
                    answer = await plugin.connection.call(
                        PLUGIN_SERVICE,
                        "Synchronize",
                        request,
                        api_pb2.SynchronizeResponse(),
                        budget,
                    )
                    if request.more and (answer.update or not answer.more):
                        raise PluginRejected(
                            "cannot take a Synchronize split over several messages"
                        )
        except TimeoutError:
            raise CallError(
                Code.DEADLINE_EXCEEDED,
                f"{plugin.id}: Synchronize in {len(requests)} messages took over {budget:g}s",
            ) from None
        return list(answer.update)

    async def _catch_up(self, plugin: Plugin) -> None:
        """Tell a plugin that has just synchronized the events that came meanwhile, in
        order; they went on without it, so what it answers changes nothing."""
        assert plugin.backlog is not None
        while plugin.backlog:
            method, request, reply = plugin.backlog.pop(0)
            try:
                answer = await self._ask(plugin, method, request, reply)
            except CallError as e:
                log.warning(
                    "NRI %s, which came while the plugin synchronized: %s (too late to refuse)",
                    method,
                    e.message,
                )
                continue
            if answer is None:
                return
            if answer.ByteSize():
                log.warning(
                    "NRI: plugin %s: its answer to %s, which came while it synchronized, "
                    "is too late to apply",
                    plugin.id,
                    method,
                )
        plugin.backlog = None

    async def _on_update_request(
        self, plugin: Plugin | None, request: api_pb2.UpdateContainersRequest
    ) -> list[api_pb2.ContainerUpdate]:
        if plugin is None:
            raise CallError(Code.FAILED_PRECONDITION, "plugin is not registered yet")
        if len(request.update) > MAX_UPDATES:
            raise CallError(Code.RESOURCE_EXHAUSTED, _too_many_updates(len(request.update)))
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
        self,
        event: int,
        method: str,
        request: ProtoMessage,
        reply: Callable[[], Reply],
        journal: Callable[[], None] = lambda: None,
    ) -> list[tuple[Plugin, Reply]]:
        """Send one event to every subscribed plugin in order; their answers.

        `journal` runs where the plugins are picked, so that the object is either in a
        connecting plugin's snapshot or in this event for it. A plugin still
        synchronizing gets the event in its backlog and is not waited for. A plugin that
        times out or disconnects is dropped and the event goes on to the next; a plugin
        that answers with an error status fails the event (CallError), and so does a
        request too big to send.
        """
        async with self.lock:
            journal()
            picked = [plugin for plugin in self._plugins if plugin.subscribed(event)]
        answers: list[tuple[Plugin, Reply]] = []
        for plugin in picked:
            if plugin not in self._plugins:
                continue  # dropped while an earlier plugin answered
            if plugin.backlog is not None:
                if len(plugin.backlog) >= MAX_BACKLOG:
                    await self._drop(plugin, f"{MAX_BACKLOG} events came while it synchronized")
                else:
                    plugin.backlog.append((method, request, reply))
                continue
            with tracing.span(f"NRI {method} {plugin.id}", **{"nri.plugin": plugin.id}):
                answer = await self._ask(plugin, method, request, reply)
            if answer is not None:
                answers.append((plugin, answer))
        return answers

    async def _ask(
        self, plugin: Plugin, method: str, request: ProtoMessage, reply: Callable[[], Reply]
    ) -> Reply | None:
        """One call to one plugin within its budget: the answer, or None when the plugin
        did not answer in time or is gone (it is dropped). Raises CallError for an error
        it answered with, or a request too big to send."""
        try:
            return await plugin.connection.call(
                PLUGIN_SERVICE, method, request, reply(), self.settings.request_timeout
            )
        except ConnectionClosed as e:
            await self._drop(plugin, str(e))
        except CallError as e:
            if e.code != Code.DEADLINE_EXCEEDED:
                raise CallError(e.code, f"NRI plugin {plugin.id}: {shown(e.message)}") from e
            await self._drop(plugin, str(e))
        return None


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
    """A pre-installed plugin's configuration: NN-name.conf, else name.conf, else none.

    Blocking: run it off the event loop. Raises PluginConfigRefused for a file that is
    not a regular file (a FIFO would block its reader for ever) or is over MAX_CONFIG
    bytes or not UTF-8, OSError for one that cannot be read.
    """
    if directory is None:
        return ""
    for candidate in (f"{index}-{name}.conf", f"{name}.conf"):
        path = directory / candidate
        try:
            # Non-blocking: opening a FIFO must not wait for a writer.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PluginConfigRefused(f"{path} is not a regular file")
            data = file.read(MAX_CONFIG + 1)
        if len(data) > MAX_CONFIG:
            raise PluginConfigRefused(f"{path} is larger than {MAX_CONFIG} bytes")
        try:
            return data.decode()
        except UnicodeDecodeError as e:
            raise PluginConfigRefused(f"{path} is not UTF-8 text: {e}") from None
    return ""


# Room a SynchronizeRequest leaves in a message for the ttrpc envelope around it.
_ENVELOPE = 1024


def synchronize_requests(
    pods: list[api_pb2.PodSandbox],
    containers: list[api_pb2.Container],
    limit: int = ttrpc.MAX_MESSAGE - _ENVELOPE,
) -> list[api_pb2.SynchronizeRequest]:
    """The pods and containers in as few SynchronizeRequests as fit `limit` bytes each,
    in order, every one but the last with `more` set. Raises PluginRejected for an object
    that does not fit a message by itself."""
    requests = [api_pb2.SynchronizeRequest()]
    used = 0
    for kind, objects in (("pods", pods), ("containers", containers)):
        for described in objects:
            size = described.ByteSize()
            # Its field's tag, its length, itself; and room for the `more` flag.
            cost = 1 + _varint_size(size) + size
            if cost + 2 > limit:
                raise PluginRejected(
                    f"{kind[:-1]} {described.id} is described in {size} bytes, over the "
                    f"{ttrpc.MAX_MESSAGE}-byte limit of a message"
                )
            if used + cost + 2 > limit:
                requests.append(api_pb2.SynchronizeRequest())
                used = 0
            getattr(requests[-1], kind).append(described)
            used += cost
    for request in requests[:-1]:
        request.more = True
    return requests


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """A peer's text as the daemon repeats it (in a log line, a status): cut at `limit`."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


def _too_many_updates(count: int) -> str:
    return (
        f"{count} container updates in one request, over the limit of {MAX_UPDATES}: none "
        f"was applied; send at most {MAX_UPDATES} per request"
    )


def _registration_problem(request: api_pb2.RegisterPluginRequest) -> str:
    if not _NAME.fullmatch(request.plugin_name):
        return f"invalid plugin name {shown(repr(request.plugin_name), 64)}"
    if not _INDEX.fullmatch(request.plugin_idx):
        return f"invalid plugin index {shown(repr(request.plugin_idx), 64)}, must be 2 digits"
    return ""
