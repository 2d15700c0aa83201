"""UpdateRuntimeConfig: the node's pod CIDR from kubelet, only recorded."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView

log = logging.getLogger("cri_shim.server")


async def update_runtime_config(
    view: RuntimeView,
    request: api_pb2.UpdateRuntimeConfigRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdateRuntimeConfigResponse:
    # kubelet sends the node's pod CIDR at start. Addressing belongs to the CNI
    # configuration (as with CRI-O and containerd's default), so it is only recorded.
    cidr = request.runtime_config.network_config.pod_cidr
    if cidr:
        log.info("kubelet reports pod CIDR %s (addressing stays with the CNI configuration)", cidr)
    return api_pb2.UpdateRuntimeConfigResponse()
