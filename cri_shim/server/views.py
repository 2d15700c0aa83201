"""What the handlers may use: one narrow view per servicer, built by the composition root.

Each view holds the domain objects its RPCs call, typed by the protocols below,
which name only the calls the edge makes: no handler reaches the state database, the
journal or the host, and a reader sees here all that the edge depends on.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.state.records import ContainerRecord, ImageRecord, SandboxRecord
from cri_shim.tracing import Tracer

if TYPE_CHECKING:
    import grpc

    from cri_shim.images.auth import Credentials
    from cri_shim.images.store import FsInfo
    from cri_shim.inspection.census import Census
    from cri_shim.inspection.usage import UsageCollector
    from cri_shim.lifecycle.events import EventBus
    from cri_shim.lifecycle.pod_resources import PodResources
    from cri_shim.streaming.on_demand import StreamingOnDemand


class Identifies(Protocol):
    def identify(self, ref: str) -> tuple[str, str] | None: ...


@dataclass(frozen=True)
class ObjectNames:
    """The full ID and name of a pod or container named by an ID or a prefix of one (for
    the log lines of the request, or of the exit, that names it)."""

    sandboxes: Identifies
    containers: Identifies

    def identify(self, kind: str, ref: str) -> tuple[str, str] | None:
        return (self.sandboxes if kind == "sandbox" else self.containers).identify(ref)


class Admission(Protocol):
    """server/limits.py's RequestLimiter."""

    def admit(self, rpc: str, deadline: float | None) -> AbstractAsyncContextManager[None]: ...

    def check_replies(self, rpc: str, size: int = 0) -> None: ...

    def hold_reply(self, rpc: str, reply: Any, context: grpc.aio.ServicerContext) -> bytes: ...


class RpcObserver(Protocol):
    def observe_rpc(self, method: str, code: str, seconds: float) -> None: ...


class CallNoticer(Protocol):
    """loop_monitor.py's LoopMonitor, which samples while calls arrive."""

    def note_call(self) -> None: ...

    def serving(self) -> AbstractContextManager[None]: ...


class Sandboxes(Protocol):
    async def run(
        self, config: api_pb2.PodSandboxConfig, runtime_handler: str, deadline: float | None
    ) -> str: ...
    async def stop(self, ref: str) -> None: ...
    async def remove(self, ref: str) -> None: ...
    def get(self, ref: str) -> SandboxRecord: ...
    def list(self) -> list[SandboxRecord]: ...
    def network_status(self) -> tuple[bool, str, str]: ...


class PodNamespaces(Protocol):
    def netns_of(self, ref: str) -> Path | None: ...


class ExecResult(Protocol):
    @property
    def stdout(self) -> bytes: ...
    @property
    def stderr(self) -> bytes: ...
    @property
    def exit_code(self) -> int: ...


class AppArmorStatus(Protocol):
    def enabled(self) -> bool: ...
    def runtime_default(self) -> str: ...


class HandlerFeatures(Protocol):
    @property
    def recursive_read_only_mounts(self) -> bool: ...
    @property
    def user_namespaces(self) -> bool: ...


class Containers(Protocol):
    @property
    def backends(self) -> Mapping[str, object]: ...
    @property
    def apparmor(self) -> AppArmorStatus: ...
    async def create(
        self, sandbox_ref: str, config: api_pb2.ContainerConfig, deadline: float | None
    ) -> str: ...
    async def start(self, ref: str) -> None: ...
    async def stop(self, ref: str, timeout: float) -> None: ...
    async def remove(self, ref: str) -> None: ...
    async def exec_sync(self, ref: str, cmd: list[str], timeout: float) -> ExecResult: ...
    async def reopen_log(self, ref: str) -> None: ...
    async def update_resources(self, ref: str, resources: Any) -> None: ...
    def get(self, ref: str) -> ContainerRecord: ...
    def get_running(self, ref: str) -> ContainerRecord: ...
    def list(self, sandbox_id: str | None = None) -> list[ContainerRecord]: ...
    def features_of(self, handler: str) -> HandlerFeatures: ...


class Images(Protocol):
    def list(self, filter_ref: str | None = None) -> list[ImageRecord]: ...
    def get(self, ref: str) -> ImageRecord | None: ...
    def remove(self, ref: str) -> ImageRecord | None: ...
    def fs_info(self) -> FsInfo: ...


class Puller(Protocol):
    async def pull(self, image: str, credentials: Credentials) -> ImageRecord: ...


@dataclass(frozen=True)
class EdgeView:
    """What every call's wrapper uses (server/rpc.py): admission, the count of RPCs (None
    without `[metrics] listen`), the names of the objects a request names, the tracer and
    the event loop's monitor."""

    config: Config
    limiter: Admission
    names: ObjectNames
    rpc_metrics: RpcObserver | None
    # A span per call when `[tracing] endpoint` is set; the no-op tracer otherwise.
    tracer: Tracer
    # None with `[metrics] event_loop_sample_interval = 0`.
    loop_monitor: CallNoticer | None


@dataclass(frozen=True)
class RuntimeView(EdgeView):
    """RuntimeService's handlers: pods, containers, their usage and events, streaming."""

    sandboxes: Sandboxes
    pods: PodNamespaces
    containers: Containers
    pod_resources: PodResources
    events: EventBus
    usage: UsageCollector
    census: Census
    streaming: StreamingOnDemand


@dataclass(frozen=True)
class ImageView(EdgeView):
    """ImageService's handlers: the image store and the daemon's one puller (its
    in-flight maps are what lets concurrent pulls share downloads)."""

    images: Images
    puller: Puller
