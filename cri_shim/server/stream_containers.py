"""StreamContainers: ListContainers' items, one per message (server/listing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.list_containers import containers_listed

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stream_containers(
    view: RuntimeView,
    request: api_pb2.StreamContainersRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        containers_listed(view, request.filter),
        context,
        lambda c: api_pb2.StreamContainersResponse(containers=[c]),
    )
