"""An NRI plugin for the tests: connects to the runtime's NRI socket, registers, records
every call it gets in order, and answers as the test tells it (adjustments, a failure, a
delay, a hold until the test lets it go). It takes a Synchronize split over several
messages as upstream NRI's stub does. It speaks the protocol over the real socket, through
the same codecs as the runtime but in the plugin's roles (it serves the Plugin service and
calls the Runtime one).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import Message

from cri_shim.nri import mux
from cri_shim.nri.adaptation import PLUGIN_SERVICE, RUNTIME_SERVICE, event_bit
from cri_shim.nri.api import api_pb2
from cri_shim.nri.connection import Handler, MuxedConnection
from cri_shim.nri.ttrpc import CallError, Code
from tests.waiting import until

# method → (request type, response type)
METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Configure": (api_pb2.ConfigureRequest, api_pb2.ConfigureResponse),
    "Synchronize": (api_pb2.SynchronizeRequest, api_pb2.SynchronizeResponse),
    "Shutdown": (api_pb2.Empty, api_pb2.Empty),
    "RunPodSandbox": (api_pb2.RunPodSandboxRequest, api_pb2.RunPodSandboxResponse),
    "UpdatePodSandbox": (api_pb2.UpdatePodSandboxRequest, api_pb2.UpdatePodSandboxResponse),
    "PostUpdatePodSandbox": (
        api_pb2.PostUpdatePodSandboxRequest,
        api_pb2.PostUpdatePodSandboxResponse,
    ),
    "StopPodSandbox": (api_pb2.StopPodSandboxRequest, api_pb2.StopPodSandboxResponse),
    "RemovePodSandbox": (api_pb2.RemovePodSandboxRequest, api_pb2.RemovePodSandboxResponse),
    "CreateContainer": (api_pb2.CreateContainerRequest, api_pb2.CreateContainerResponse),
    "PostCreateContainer": (
        api_pb2.PostCreateContainerRequest,
        api_pb2.PostCreateContainerResponse,
    ),
    "StartContainer": (api_pb2.StartContainerRequest, api_pb2.StartContainerResponse),
    "PostStartContainer": (api_pb2.PostStartContainerRequest, api_pb2.PostStartContainerResponse),
    "UpdateContainer": (api_pb2.UpdateContainerRequest, api_pb2.UpdateContainerResponse),
    "PostUpdateContainer": (
        api_pb2.PostUpdateContainerRequest,
        api_pb2.PostUpdateContainerResponse,
    ),
    "StopContainer": (api_pb2.StopContainerRequest, api_pb2.StopContainerResponse),
    "RemoveContainer": (api_pb2.RemoveContainerRequest, api_pb2.RemoveContainerResponse),
    "StateChange": (api_pb2.StateChangeEvent, api_pb2.Empty),
}

# A responder gets the decoded request and returns the response (or raises CallError).
Responder = Callable[[Message], Message]


@dataclass
class RecordingPlugin:
    name: str = "recorder"
    index: str = "10"
    events: list[int] = field(default_factory=list)  # empty: every event
    responders: dict[str, Responder] = field(default_factory=dict)
    delays: dict[str, float] = field(default_factory=dict)
    # A method held until the test sets its event (from any thread).
    holds: dict[str, threading.Event] = field(default_factory=dict)
    calls: list[tuple[str, Message]] = field(default_factory=list)
    connection: MuxedConnection | None = None
    loop: asyncio.AbstractEventLoop | None = None
    _reading: asyncio.Task[None] | None = None
    _writer: asyncio.StreamWriter | None = None

    @property
    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]

    def told(self, kind: str = "container") -> list[str]:
        """The IDs of the containers (or pods) it heard of, from every Synchronize message
        and every CreateContainer (RunPodSandbox), in order: one told twice is here twice."""
        created = "CreateContainer" if kind == "container" else "RunPodSandbox"
        seen: list[str] = []
        for method, request in self.calls:
            if isinstance(request, api_pb2.SynchronizeRequest):
                listed = request.containers if kind == "container" else request.pods
                seen += [described.id for described in listed]
            elif method == created:
                seen.append(getattr(request, kind).id)
        return seen

    def stop_reading(self) -> None:
        """Read nothing more from the runtime (a plugin that is wedged), from its loop."""
        assert self._writer is not None
        self._writer.transport.pause_reading()

    def _handler(self, method: str) -> Handler:
        request_type, response_type = METHODS[method]

        async def handle(payload: bytes) -> bytes:
            request = request_type.FromString(payload)
            self.calls.append((method, request))
            if method in self.delays:
                await asyncio.sleep(self.delays[method])
            if method in self.holds:
                await asyncio.to_thread(self.holds[method].wait, 120)
            if method in self.responders:
                return self.responders[method](request).SerializeToString()
            if isinstance(request, api_pb2.SynchronizeRequest) and request.more:
                return api_pb2.SynchronizeResponse(more=True).SerializeToString()
            if method == "Configure":
                mask = 0
                for event in self.events:
                    mask |= event_bit(event)
                return api_pb2.ConfigureResponse(events=mask).SerializeToString()
            return response_type().SerializeToString()

        return handle

    async def connect(self, socket_path: Path, register: bool = True) -> None:
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        await self._serve(reader, writer, register)

    async def connect_inherited(self, fd: int) -> None:
        """Connect over the socket a runtime that launched this plugin passed it, as the
        NRI_PLUGIN_SOCKET fd, and register."""
        reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
        await self._serve(reader, writer, register=True)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, register: bool
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._writer = writer
        self.connection = MuxedConnection(
            reader,
            writer,
            serve_conn=mux.PLUGIN_SERVICE_CONN,
            call_conn=mux.RUNTIME_SERVICE_CONN,
            handlers={f"{PLUGIN_SERVICE}/{m}": self._handler(m) for m in METHODS},
            name=f"{self.index}-{self.name}",
        )
        self._reading = asyncio.get_running_loop().create_task(self.connection.run())
        if register:
            await self.register()

    async def register(self) -> None:
        assert self.connection is not None
        await self.connection.call(
            RUNTIME_SERVICE,
            "RegisterPlugin",
            api_pb2.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index),
            api_pb2.Empty(),
            5.0,
        )

    async def wait_for(self, method: str, count: int = 1, timeout: float = 5.0) -> None:
        await until(lambda: self.methods.count(method) >= count, timeout, interval=0.005)

    async def update_containers(
        self, updates: list[api_pb2.ContainerUpdate]
    ) -> api_pb2.UpdateContainersResponse:
        assert self.connection is not None
        return await self.connection.call(
            RUNTIME_SERVICE,
            "UpdateContainers",
            api_pb2.UpdateContainersRequest(update=updates),
            api_pb2.UpdateContainersResponse(),
            5.0,
        )

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
        if self._reading is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading


def fail_with(message: str) -> Responder:
    def respond(_request: Message) -> Message:
        raise CallError(Code.UNKNOWN, message)

    return respond


class PluginThread:
    """A RecordingPlugin on an event loop of its own, for tests whose client is blocking
    (the daemon's gRPC stubs): connected on start, closed on stop."""

    def __init__(self, plugin: RecordingPlugin, socket_path: Path) -> None:
        self.plugin = plugin
        self._socket_path = socket_path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> RecordingPlugin:
        self._thread.start()
        connect = self.plugin.connect(self._socket_path)
        asyncio.run_coroutine_threadsafe(connect, self._loop).result(timeout=10)
        return self.plugin

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.plugin.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
