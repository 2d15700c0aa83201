"""The composition root: the daemon's whole object graph, built in one place.

Every collaborator is handed over through a constructor; nothing is patched in after
construction. The daemon starts and stops what this builds (daemon.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from cri_shim import __version__
from cri_shim.api.v1 import api_pb2
from cri_shim.config import BUNDLED_CNI_DIR, Config
from cri_shim.images.on_demand import PullerOnDemand
from cri_shim.images.policy import UnpackPolicy
from cri_shim.images.store import ImageStore
from cri_shim.lifecycle.containers import ContainerLifecycle
from cri_shim.lifecycle.events import ContainerEvent, EventBus
from cri_shim.lifecycle.pause import PauseProcesses
from cri_shim.lifecycle.sandboxes import Pods, SandboxLifecycle
from cri_shim.loop_monitor import LoopMonitor
from cri_shim.metrics import Metrics
from cri_shim.network.cni import CniNetwork
from cri_shim.network.netns import NamespacePinner
from cri_shim.nri.adaptation import Adaptation, NriSettings
from cri_shim.nri.api import api_pb2 as nri_api
from cri_shim.nri.hooks import NriHooks
from cri_shim.nri.objects import container_of_record, pod_of_record
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.gvisor import SandboxForwarding
from cri_shim.server.components import Components
from cri_shim.server.events import render_event
from cri_shim.server.limits import RequestLimiter
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.db import Database
from cri_shim.state.journal import Journal
from cri_shim.state.ledger import Ledger
from cri_shim.state.sandboxes import SandboxRepository
from cri_shim.streaming.on_demand import StreamingOnDemand
from cri_shim.streaming.runc_backend import RuncStreamingBackend


def build_components(config: Config) -> Components:
    for path in (config.root, config.run_root):
        # Made so that others may pass through (a container in a user namespace of its
        # own reaches its root filesystem as an unprivileged id) but neither list nor
        # read. An existing directory keeps the mode its operator gave it.
        path.mkdir(mode=0o711, parents=True, exist_ok=True)
    db = Database(config.state_db)
    journal = Journal(db)
    ledger = Ledger(db)
    sandbox_rows = SandboxRepository(db)
    container_rows = ContainerRepository(db)
    backends = build_backends(config)

    # Port-forward into a gVisor pod: through its sandbox, or refused by name.
    forwarding = SandboxForwarding(backends, config.runtime)
    pods = Pods(sandbox_rows, forwarding.check)
    components: Components | None = None

    def render(event: ContainerEvent) -> api_pb2.ContainerEventResponse | None:
        # Events render the pod's and its containers' statuses, which needs the whole
        # graph; the bus renders only for a subscriber, and none exists before serving.
        assert components is not None
        return render_event(components, event)

    events = EventBus(render=render)

    def layers_in_use(chains: Collection[str]) -> Collection[str]:
        # Layers under a container's root filesystem must outlive their image's removal.
        return set(chains) & container_rows.layers_in_use()

    images = ImageStore(
        config.root,
        db,
        in_use=layers_in_use,
        unpack_policy=UnpackPolicy.from_config(config.images),
    )
    pause = PauseProcesses(journal, backends, config.runtime.handlers)

    async def nri_snapshot() -> tuple[list[nri_api.PodSandbox], list[nri_api.Container]]:
        # What a connecting NRI plugin is synchronized with (under the lock every event
        # takes): the visible objects, as they are now, and those other plugins were told
        # of that are not visible yet (in flight, or cached), so that none is lost to a
        # plugin that connects while they are being created. The graph is built by then.
        assert components is not None
        pods, containers = nri.announced()
        pods.update((s.id, pod_of_record(s)) for s in components.sandboxes.list())
        containers.update((c.id, container_of_record(c)) for c in components.containers.list())
        return list(pods.values()), list(containers.values())

    async def nri_update(container_id: str, resources: dict[str, Any]) -> None:
        assert components is not None
        await components.containers.update_resources(container_id, resources)

    adaptation = (
        Adaptation(
            NriSettings(
                socket_path=config.nri.socket_path,
                registration_timeout=config.nri.plugin_registration_timeout,
                request_timeout=config.nri.plugin_request_timeout,
                runtime_version=__version__,
                plugin_path=config.nri.plugin_path,
                plugin_config_path=config.nri.plugin_config_path,
            ),
            nri_snapshot,
            nri_update,
        )
        if config.nri.enable
        else None
    )
    nri = NriHooks(journal, adaptation)
    containers = ContainerLifecycle(
        config,
        container_rows,
        pods,
        journal,
        images,
        backends,
        events=events,
        pause=pause,
        nri=nri,
    )
    sandboxes = SandboxLifecycle(
        config,
        pods,
        journal,
        ledger,
        NamespacePinner(config.run_root),
        CniNetwork(config.network.config_dir, config.network.bin_dirs, BUNDLED_CNI_DIR),
        events=events,
        containers=containers,
        handler_features=containers.features_of,
        pause=pause,
        nri=nri,
    )

    def creations_in_flight() -> int:
        return len(sandboxes.coordinator.stats()["in_flight"]) + len(
            containers.coordinator.stats()["in_flight"]
        )

    streaming = StreamingOnDemand(
        config.streaming.address,
        config.streaming.tls_cert,
        config.streaming.tls_key,
        RuncStreamingBackend(
            containers.streaming_endpoint,
            pods.netns_of,
            resolve_relay=lambda pod, port: forwarding.relay(pods.get_ready(pod), port),
        ),
    )
    interval = config.metrics.event_loop_sample_interval
    components = Components(
        config=config,
        db=db,
        journal=journal,
        ledger=ledger,
        sandboxes=sandboxes,
        containers=containers,
        images=images,
        puller=PullerOnDemand(images, config.images),
        limiter=RequestLimiter(config.requests, creations_in_flight),
        streaming=streaming,
        # Counted only to be exported: without `[metrics] listen` nothing is counted.
        metrics=Metrics() if config.metrics.listen else None,
        nri=nri,
        loop_monitor=LoopMonitor(interval) if interval else None,
    )
    return components


def build_backends(config: Config) -> dict[str, RuntimeBackend]:
    backends = {}
    for name, handler in config.runtime.handlers.items():
        backends[name] = RuntimeBackend(
            name,
            handler.path,
            handler.root or config.run_root / "runtime" / name,
            config.runtime.conmon,
            config.run_root / "conmon" / name,
            runtime_args=handler.runtime_args,
        )
    return backends
