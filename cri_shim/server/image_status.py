"""ImageStatus: a stored image, or nothing (which kubelet reads as "pull it")."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.image_messages import cri_image, image_ref

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView


async def image_status(
    view: ImageView, request: api_pb2.ImageStatusRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ImageStatusResponse:
    record = view.images.get(image_ref(request.image, "ImageStatus"))
    if record is None:
        # Not an error: kubelet asks before pulling, and reads "no image" as "pull it".
        return api_pb2.ImageStatusResponse()
    response = api_pb2.ImageStatusResponse(image=cri_image(record))
    if request.verbose:
        info = {
            "id": record.id,
            "chainID": record.layers[-1] if record.layers else "",
            "layers": record.layers,
            "manifestDigest": record.manifest_digest,
            "createdAt": record.created_at,
            "imageSpec": record.config,
        }
        response.info["info"] = json.dumps(info, sort_keys=True)
    return response
