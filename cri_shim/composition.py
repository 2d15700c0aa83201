"""The composition root: the daemon's whole object graph, built in one place.

Every collaborator is handed over through a constructor; nothing is patched in after
construction. The daemon starts and stops what this builds (daemon.py); the gRPC
servicers and the metrics endpoint get only their narrow views of it (server/views.py,
inspection/census.py): persistence stays with the lifecycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cri_shim import __version__
from cri_shim.config import BUNDLED_CNI_DIR, Config, TracingConfig
from cri_shim.host.heap import HeapTrimmer
from cri_shim.host.systemd_manager import SystemdManager
from cri_shim.images.on_demand import PullerOnDemand
from cri_shim.images.policy import UnpackPolicy
from cri_shim.images.store import ImageStore
from cri_shim.inspection.census import Census
from cri_shim.inspection.host import HostReader
from cri_shim.inspection.layer_usage import LayerUsageCache
from cri_shim.inspection.usage import UsageCollector
from cri_shim.lifecycle.containers import ContainerLifecycle
from cri_shim.lifecycle.events import EventBus
from cri_shim.lifecycle.pause import SandboxContainers
from cri_shim.lifecycle.pod_resources import PodResources
from cri_shim.lifecycle.sandboxes import Pods, SandboxLifecycle
from cri_shim.lifecycle.statuses import EventMessages
from cri_shim.loop_monitor import LoopMonitor
from cri_shim.metrics import Metrics
from cri_shim.network.cni import CniNetwork
from cri_shim.network.netns import NamespacePinner
from cri_shim.nri.actions import register_inert
from cri_shim.runtime.cgroup_driver import driver_named, resolve_cgroup_manager, systemd_booted
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.conmon_scope import ConmonScopes
from cri_shim.runtime.monitors import MonitorWatch
from cri_shim.runtime.oci import CallObserver
from cri_shim.runtime.oom_watch import OomWatch
from cri_shim.runtime.sandbox_forwarding import SandboxForwarding
from cri_shim.server.limits import RequestLimiter
from cri_shim.server.views import ImageView, ObjectNames, RuntimeView
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.db import Database
from cri_shim.state.journal import Journal
from cri_shim.state.ledger import Ledger
from cri_shim.state.records import SandboxRecord
from cri_shim.state.sandboxes import SandboxRepository
from cri_shim.streaming.on_demand import StreamingOnDemand
from cri_shim.tracing import NO_TRACER, Tracer

if TYPE_CHECKING:
    from cri_shim.nri.adaptation import Snapshot, UpdateResources
    from cri_shim.nri.api import api_pb2 as nri_api
    from cri_shim.nri.hooks import NriHooks
    from cri_shim.streaming.backend import StreamingBackend


@dataclass(frozen=True)
class Graph:
    """What the daemon restores, runs and closes, and the views it serves from."""

    config: Config
    db: Database
    journal: Journal
    sandboxes: SandboxLifecycle
    containers: ContainerLifecycle
    nri: NriHooks | None  # None unless `[nri] enable` is set
    streaming: StreamingOnDemand
    # The daemon's one puller: its in-flight maps are what lets concurrent pulls share
    # downloads, so there must be exactly one.
    puller: PullerOnDemand
    # Counted only to be exported: without `[metrics] listen` nothing is counted.
    metrics: Metrics | None
    census: Census
    names: ObjectNames
    runtime_view: RuntimeView
    image_view: ImageView
    tracer: Tracer
    # Every conmon, watched until its container is deleted (runtime/monitors.py).
    monitors: MonitorWatch
    # Every container's memory.events on cgroup v2, for its OOM kills (runtime/oom_watch.py).
    oom_watch: OomWatch
    # Gives malloc's free pages back to the kernel (host/heap.py), soon after replies that
    # waited for their clients are let go.
    heap: HeapTrimmer


@dataclass(frozen=True)
class _Storage:
    db: Database
    journal: Journal
    ledger: Ledger
    pods: Pods
    container_rows: ContainerRepository
    images: ImageStore


def build_graph(config: Config) -> Graph:
    config = _with_cgroup_driver(config)
    for path in (config.root, config.run_root):
        # Made so that others may pass through (a container in a user namespace of its
        # own reaches its root filesystem as an unprivileged id) but neither list nor
        # read. An existing directory keeps the mode its operator gave it.
        path.mkdir(mode=0o711, parents=True, exist_ok=True)
    metrics = Metrics() if config.metrics.listen else None
    observe_call = metrics.observe_call if metrics is not None else None
    monitors = MonitorWatch()
    oom_watch = OomWatch()
    backends = build_backends(config, observe_call, monitors, oom_watch)
    # Port-forward into a gVisor pod: through its sandbox, or refused by name.
    forwarding = SandboxForwarding(backends, config.runtime)
    storage = _storage(config, forwarding.check)
    tracer = build_tracer(config.tracing)
    nri, containers, sandboxes = _lifecycle(config, storage, backends, observe_call, tracer)
    interval = config.metrics.event_loop_sample_interval
    census = Census(sandboxes, containers, LoopMonitor(interval) if interval else None)
    names = ObjectNames(sandboxes.coordinator, containers.coordinator)
    streaming = StreamingOnDemand(
        config.streaming.address,
        config.streaming.tls_cert,
        config.streaming.tls_key,
        lambda: _streaming_backend(containers, storage, forwarding),
    )
    heap = HeapTrimmer()
    limiter = RequestLimiter(config.requests, census.creations_in_flight, heap.freed)
    puller = PullerOnDemand(storage.images, config.images)
    runtime_view = RuntimeView(
        config=config,
        limiter=limiter,
        names=names,
        rpc_metrics=metrics,
        tracer=tracer,
        loop_monitor=census.loop_monitor,
        sandboxes=sandboxes,
        pods=storage.pods,
        containers=containers,
        pod_resources=PodResources(sandboxes.get, nri),
        events=sandboxes.events,
        usage=UsageCollector(
            sandboxes,
            containers,
            HostReader(containers.backend_of, LayerUsageCache(config.metrics.layer_usage_max_age)),
        ),
        census=census,
        streaming=streaming,
    )
    return Graph(
        config=config,
        db=storage.db,
        journal=storage.journal,
        sandboxes=sandboxes,
        containers=containers,
        nri=nri,
        streaming=streaming,
        puller=puller,
        metrics=metrics,
        census=census,
        names=names,
        runtime_view=runtime_view,
        tracer=tracer,
        monitors=monitors,
        oom_watch=oom_watch,
        heap=heap,
        image_view=ImageView(
            config=config,
            limiter=limiter,
            names=names,
            rpc_metrics=metrics,
            tracer=tracer,
            loop_monitor=census.loop_monitor,
            images=storage.images,
            puller=puller,
        ),
    )


def _with_cgroup_driver(config: Config) -> Config:
    """The driver decided once, before anything reads it: `auto` becomes the one the host
    runs; a driver the host cannot run stops the start (ConfigError)."""
    manager = resolve_cgroup_manager(
        config.cgroup_manager, systemd_running=systemd_booted(), conmon_cgroup=config.conmon_cgroup
    )
    return dataclasses.replace(config, cgroup_manager=manager)


def _storage(config: Config, forwardable: Callable[[SandboxRecord], None]) -> _Storage:
    db = Database(config.state_db)
    container_rows = ContainerRepository(db)

    def layers_in_use(chains: Collection[str]) -> Collection[str]:
        # Layers under a container's root filesystem must outlive their image's removal.
        return set(chains) & container_rows.layers_in_use()

    images = ImageStore(
        config.root,
        db,
        in_use=layers_in_use,
        unpack_policy=UnpackPolicy.from_config(config.images),
    )
    pods = Pods(SandboxRepository(db), forwardable)
    return _Storage(db, Journal(db), Ledger(db), pods, container_rows, images)


def _streaming_backend(
    containers: ContainerLifecycle, storage: _Storage, forwarding: SandboxForwarding
) -> StreamingBackend:
    """The backend that reaches containers for exec, attach and port-forward, loaded with
    the first streaming request (StreamingOnDemand)."""
    from cri_shim.streaming.runc_backend import RuncStreamingBackend

    return RuncStreamingBackend(
        containers.streaming_endpoint,
        storage.pods.netns_of,
        resolve_relay=lambda pod, port: forwarding.relay(storage.pods.get_ready(pod), port),
    )


def _lifecycle(
    config: Config,
    storage: _Storage,
    backends: dict[str, RuntimeBackend],
    observe_call: CallObserver | None,
    tracer: Tracer,
) -> tuple[NriHooks | None, ContainerLifecycle, SandboxLifecycle]:
    pods, journal = storage.pods, storage.journal
    # An event is rendered when it happens, and only for a subscriber: the pod's status
    # and its containers' as recorded at that moment.
    events = EventBus(
        render=EventMessages(pods.get, storage.container_rows.list_visible_in),
        max_subscribers=config.events.max_subscribers,
        max_backlog_bytes=config.events.max_backlog_bytes,
    )
    pause = SandboxContainers(journal, backends)

    # NRI plugins and the container lifecycle call each other (a creation asks the
    # plugins; a plugin updates a container), so these two find the other side when they
    # are called: never before the graph is built, as the daemon starts NRI after restore.
    async def nri_snapshot() -> tuple[list[nri_api.PodSandbox], list[nri_api.Container]]:
        # What a connecting plugin is synchronized with (under the lock every event
        # takes): the visible objects, as they are now, and those other plugins were told
        # of that are not visible yet (in flight, or cached), so that none is lost to a
        # plugin that connects while they are being created.
        from cri_shim.nri.objects import container_of_record, pod_of_record

        assert nri is not None
        told_pods, told_containers = nri.announced()
        told_pods.update(
            (s.id, pod_of_record(s)) for s in pods.list() if not nri.removal_told(s.id)
        )
        told_containers.update((c.id, container_of_record(c)) for c in containers.list())
        return list(told_pods.values()), list(told_containers.values())

    async def nri_update(container_id: str, resources: dict[str, Any]) -> None:
        await containers.update_resources(container_id, resources)

    nri = _nri_hooks(config, journal, nri_snapshot, nri_update)
    containers = ContainerLifecycle(
        config,
        storage.container_rows,
        pods,
        journal,
        storage.images,
        backends,
        events=events,
        pause=pause,
        nri=nri,
        tracer=tracer,
    )
    sandboxes = SandboxLifecycle(
        config,
        pods,
        journal,
        storage.ledger,
        NamespacePinner(config.run_root),
        CniNetwork(
            config.network.config_dir,
            config.network.bin_dirs,
            BUNDLED_CNI_DIR,
            observe_call=observe_call,
        ),
        events=events,
        containers=containers,
        handler_features=containers.features_of,
        pause=pause,
        nri=nri,
        tracer=tracer,
    )
    return nri, containers, sandboxes


def _nri_hooks(
    config: Config, journal: Journal, snapshot: Snapshot, update: UpdateResources
) -> NriHooks | None:
    """NRI's hooks when `[nri] enable` is set, its modules imported only then; else None,
    and its journal steps (of a journal written while it was on) inform nobody."""
    if not config.nri.enable:
        register_inert(journal)
        return None
    from cri_shim.nri.adaptation import Adaptation, NriSettings
    from cri_shim.nri.hooks import NriHooks

    settings = NriSettings(
        socket_path=config.nri.socket_path,
        registration_timeout=config.nri.plugin_registration_timeout,
        request_timeout=config.nri.plugin_request_timeout,
        runtime_version=__version__,
        plugin_path=config.nri.plugin_path,
        plugin_config_path=config.nri.plugin_config_path,
    )
    return NriHooks(journal, Adaptation(settings, snapshot, update))


def build_backends(
    config: Config,
    observe_call: CallObserver | None = None,
    monitors: MonitorWatch | None = None,
    oom_watch: OomWatch | None = None,
) -> dict[str, RuntimeBackend]:
    backends = {}
    driver = driver_named(config.cgroup_manager)
    # One connection to systemd for every handler's conmon scopes.
    scopes = ConmonScopes(SystemdManager(), config.conmon_cgroup) if driver.systemd else None
    for name, handler in config.runtime.handlers.items():
        backends[name] = RuntimeBackend(
            name,
            handler.path,
            handler.root or config.run_root / "runtime" / name,
            config.runtime.conmon,
            config.run_root / "conmon" / name,
            observe_call=observe_call,
            runtime_args=(*driver.runtime_args, *handler.runtime_args),
            monitors=monitors,
            oom_watch=oom_watch,
            scopes=scopes,
            pod_sandbox=handler.pod_sandbox,
        )
    return backends


def build_tracer(config: TracingConfig) -> Tracer:
    """The OpenTelemetry tracer when an endpoint is set (its stack imported only then),
    else the no-op one."""
    if not config.endpoint:
        return NO_TRACER
    from cri_shim.tracing.otel import OtelTracer

    return OtelTracer(config)
