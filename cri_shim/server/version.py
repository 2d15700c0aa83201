"""Version: the runtime's name and version, and the CRI version it speaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim import __version__
from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


RUNTIME_NAME = "cri-shim"
KUBE_API_VERSION = "0.1.0"


async def version(
    view: RuntimeView, request: api_pb2.VersionRequest, context: grpc.aio.ServicerContext
) -> api_pb2.VersionResponse:
    return api_pb2.VersionResponse(
        version=KUBE_API_VERSION,
        runtime_name=RUNTIME_NAME,
        runtime_version=__version__,
        runtime_api_version="v1",
    )
