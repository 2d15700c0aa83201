"""What a request handler may use: the components the composition root built.

One instance per daemon, made by `cri_shim.composition.build_components` before restore
and handed to the servicers once restore has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.images.on_demand import PullerOnDemand
from cri_shim.images.store import ImageStore
from cri_shim.lifecycle.containers import ContainerLifecycle
from cri_shim.lifecycle.sandboxes import SandboxLifecycle
from cri_shim.loop_monitor import LoopMonitor
from cri_shim.metrics import Metrics
from cri_shim.nri.hooks import NriHooks
from cri_shim.runtime.stats import CpuRates
from cri_shim.server.limits import RequestLimiter
from cri_shim.state.db import Database
from cri_shim.state.journal import Journal
from cri_shim.state.ledger import Ledger
from cri_shim.streaming.on_demand import StreamingOnDemand
from cri_shim.tracing import NO_TRACER, Tracer


@dataclass
class Components:
    config: Config
    db: Database
    journal: Journal
    ledger: Ledger
    sandboxes: SandboxLifecycle
    containers: ContainerLifecycle
    images: ImageStore
    # The daemon's one puller: its in-flight maps are what lets concurrent pulls share
    # downloads, so there must be exactly one.
    puller: PullerOnDemand
    limiter: RequestLimiter
    streaming: StreamingOnDemand
    metrics: Metrics | None
    cpu_rates: CpuRates = field(default_factory=CpuRates)
    nri: NriHooks | None = None  # None in tests that build components by hand
    # None with `[metrics] event_loop_sample_interval = 0`; the daemon runs it.
    loop_monitor: LoopMonitor | None = None
    tracer: Tracer = NO_TRACER

    def creation_stats(self) -> dict[str, Any]:
        return {
            "sandbox": self.sandboxes.coordinator.stats(),
            "container": self.containers.coordinator.stats(),
        }

    def container_statuses_of(self, sandbox_id: str) -> list[api_pb2.ContainerStatus]:
        from cri_shim.server.container import to_status

        return [to_status(c) for c in self.containers.list(sandbox_id=sandbox_id)]
