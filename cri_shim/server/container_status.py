"""ContainerStatus: a container's status as recorded (lifecycle/statuses.py); verbose adds its
runtime spec, the config.json the daemon wrote in the container's bundle."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.inspection.runtime_spec import runtime_spec_of
from cri_shim.lifecycle.statuses import to_status

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def container_status(
    view: RuntimeView, request: api_pb2.ContainerStatusRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ContainerStatusResponse:
    container = view.containers.get(request.container_id)
    response = api_pb2.ContainerStatusResponse(status=to_status(container))
    if request.verbose:
        info = {
            "id": container.id,
            "name": container.name,
            "sandboxID": container.sandbox_id,
            "pid": container.pid,
            "bundle": str(container.bundle_dir),
            "rootfs": str(container.rootfs),
            # On the loop, as runtime/conmon_launch.py writes it: a small file of the daemon's own
            # state root. A worker thread cost a call under load half a millisecond more
            # (critest's benchmark: the status right after the start, beside three others).
            "runtimeSpec": runtime_spec_of(container),
        }
        response.info["info"] = json.dumps(info, sort_keys=True)
    return response
