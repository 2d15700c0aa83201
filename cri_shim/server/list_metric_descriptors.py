"""ListMetricDescriptors: the cAdvisor metrics ListPodSandboxMetrics reports
(server/metrics_messages.py, imported by the first call: only a kubelet that takes its
stats from the CRI asks for them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def list_metric_descriptors(
    view: RuntimeView,
    request: api_pb2.ListMetricDescriptorsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListMetricDescriptorsResponse:
    from cri_shim.server.metrics_messages import metric_descriptors

    return api_pb2.ListMetricDescriptorsResponse(descriptors=metric_descriptors())
