"""ListPodSandboxStats: the usage of the pods a filter selects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.listing import selected
from cri_shim.server.stats_messages import pod_stats_message

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def pod_sandbox_stats_listed(
    view: RuntimeView, f: api_pb2.PodSandboxStatsFilter
) -> AsyncIterator[api_pb2.PodSandboxStats]:
    """The stats of the pods `f` selects: ListPodSandboxStats and StreamPodSandboxStats."""
    chosen = [s for s in view.sandboxes.list() if selected(f, s.id, s.config.labels)]
    async for usage in view.usage.pods(chosen):
        yield pod_stats_message(view, usage)


async def list_pod_sandbox_stats(
    view: RuntimeView,
    request: api_pb2.ListPodSandboxStatsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListPodSandboxStatsResponse:
    stats = await listing.collect(
        pod_sandbox_stats_listed(view, request.filter),
        "ListPodSandboxStats",
        "StreamPodSandboxStats",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListPodSandboxStatsResponse(stats=stats)
