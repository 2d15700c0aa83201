"""PodSandboxStats: a pod's usage and its containers', read live (inspection/usage.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.stats_messages import pod_stats_message

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def pod_sandbox_stats(
    view: RuntimeView, request: api_pb2.PodSandboxStatsRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PodSandboxStatsResponse:
    usage = await view.usage.pod(request.pod_sandbox_id)
    return api_pb2.PodSandboxStatsResponse(stats=pod_stats_message(view, usage))
