"""RemoveImage: an image removed with every tag; an unknown image is success."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.image_messages import image_ref

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView


async def remove_image(
    view: ImageView, request: api_pb2.RemoveImageRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RemoveImageResponse:
    # Any reference removes the image with every tag; an unknown image is success, since
    # kubelet's image GC may retry a removal whose answer it lost.
    await asyncio.to_thread(view.images.remove, image_ref(request.image, "RemoveImage"))
    return api_pb2.RemoveImageResponse()
