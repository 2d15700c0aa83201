"""ListContainers: the visible containers a filter selects (lifecycle/statuses.py makes each
item once per record)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.statuses import container_state, to_container
from cri_shim.server import listing
from cri_shim.server.listing import selected

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


def containers_listed(view: RuntimeView, f: api_pb2.ContainerFilter) -> Iterator[api_pb2.Container]:
    """The containers `f` selects, one at a time: ListContainers and StreamContainers."""
    for container in view.containers.list(sandbox_id=f.pod_sandbox_id or None):
        if selected(f, container.id, container.config.labels, container_state(container)):
            yield to_container(container)


async def list_containers(
    view: RuntimeView, request: api_pb2.ListContainersRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ListContainersResponse:
    items = await listing.collect(
        containers_listed(view, request.filter),
        "ListContainers",
        "StreamContainers",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListContainersResponse(containers=items)
