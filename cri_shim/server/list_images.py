"""ListImages: the stored images, or those a reference names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.image_messages import cri_image

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView


def images_listed(view: ImageView, f: api_pb2.ImageFilter) -> Iterator[api_pb2.Image]:
    """The images `f` selects, one at a time: ListImages and StreamImages."""
    for record in view.images.list(f.image.image.strip() or None):
        yield cri_image(record)


async def list_images(
    view: ImageView, request: api_pb2.ListImagesRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ListImagesResponse:
    items = await listing.collect(
        images_listed(view, request.filter),
        "ListImages",
        "StreamImages",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListImagesResponse(images=items)
