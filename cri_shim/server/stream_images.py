"""StreamImages: ListImages' items, one per message (server/listing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.list_images import images_listed

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView


async def stream_images(
    view: ImageView, request: api_pb2.StreamImagesRequest, context: grpc.aio.ServicerContext
) -> None:
    await listing.stream(
        images_listed(view, request.filter),
        context,
        lambda image: api_pb2.StreamImagesResponse(images=[image]),
    )
