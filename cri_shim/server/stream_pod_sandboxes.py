"""StreamPodSandboxes: ListPodSandbox's items, one per message (server/listing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.list_pod_sandbox import pod_sandboxes_listed

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stream_pod_sandboxes(
    view: RuntimeView,
    request: api_pb2.StreamPodSandboxesRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        pod_sandboxes_listed(view, request.filter),
        context,
        lambda s: api_pb2.StreamPodSandboxesResponse(pod_sandboxes=[s]),
    )
