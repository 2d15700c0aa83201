"""PullImage: the daemon's one puller fetches an image (concurrent pulls share downloads)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.image_messages import image_ref

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView

log = logging.getLogger("cri_shim.server")


async def pull_image(
    view: ImageView, request: api_pb2.PullImageRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PullImageResponse:
    # The registry client is imported by the first pull (images/on_demand.py).
    from cri_shim.images.auth import Credentials

    ref = image_ref(request.image, "PullImage")
    auth = request.auth
    credentials = Credentials.from_auth_config(
        username=auth.username,
        password=auth.password,
        auth=auth.auth,
        identity_token=auth.identity_token,
        registry_token=auth.registry_token,
    )
    log.info("PullImage %s (%s)", ref, credentials.kind)
    record = await view.puller.pull(ref, credentials)
    return api_pb2.PullImageResponse(image_ref=record.id)
