"""ListPodSandboxMetrics: each ready pod's cAdvisor metrics, read live
(server/metrics_messages.py, imported by the first call: only a kubelet that takes its
stats from the CRI asks for them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


def pod_sandbox_metrics_listed(view: RuntimeView) -> AsyncIterator[api_pb2.PodSandboxMetrics]:
    """Each ready pod's metrics, read when it is its turn: ListPodSandboxMetrics and
    StreamPodSandboxMetrics."""
    from cri_shim.server.metrics_messages import pod_metrics_message

    return view.usage.pods_figures(pod_metrics_message)


async def list_pod_sandbox_metrics(
    view: RuntimeView,
    request: api_pb2.ListPodSandboxMetricsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListPodSandboxMetricsResponse:
    pods = await listing.collect(
        pod_sandbox_metrics_listed(view),
        "ListPodSandboxMetrics",
        "StreamPodSandboxMetrics",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListPodSandboxMetricsResponse(pod_metrics=pods)
