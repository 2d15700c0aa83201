"""StreamPodSandboxStats: ListPodSandboxStats' items, one per message (server/listing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.list_pod_sandbox_stats import pod_sandbox_stats_listed

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stream_pod_sandbox_stats(
    view: RuntimeView,
    request: api_pb2.StreamPodSandboxStatsRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        pod_sandbox_stats_listed(view, request.filter),
        context,
        lambda stats: api_pb2.StreamPodSandboxStatsResponse(pod_sandbox_stats=[stats]),
    )
