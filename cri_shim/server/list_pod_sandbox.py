"""ListPodSandbox: the visible pods a filter selects."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.statuses import sandbox_state, to_pod_sandbox
from cri_shim.server import listing
from cri_shim.server.listing import selected

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


def pod_sandboxes_listed(
    view: RuntimeView, f: api_pb2.PodSandboxFilter
) -> Iterator[api_pb2.PodSandbox]:
    """The sandboxes `f` selects, one at a time: ListPodSandbox and StreamPodSandboxes."""
    for sandbox in view.sandboxes.list():
        if selected(f, sandbox.id, sandbox.config.labels, sandbox_state(sandbox)):
            yield to_pod_sandbox(sandbox)


async def list_pod_sandbox(
    view: RuntimeView, request: api_pb2.ListPodSandboxRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ListPodSandboxResponse:
    items = await listing.collect(
        pod_sandboxes_listed(view, request.filter),
        "ListPodSandbox",
        "StreamPodSandboxes",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListPodSandboxResponse(items=items)
