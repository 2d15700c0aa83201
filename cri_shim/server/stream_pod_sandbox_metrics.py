"""StreamPodSandboxMetrics: ListPodSandboxMetrics' items, one per message (server/listing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.list_pod_sandbox_metrics import pod_sandbox_metrics_listed

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stream_pod_sandbox_metrics(
    view: RuntimeView,
    request: api_pb2.StreamPodSandboxMetricsRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        pod_sandbox_metrics_listed(view),
        context,
        lambda pod: api_pb2.StreamPodSandboxMetricsResponse(pod_sandbox_metrics=[pod]),
    )
