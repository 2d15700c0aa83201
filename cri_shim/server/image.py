"""ListImages and StreamImages, ImageStatus, PullImage, RemoveImage, ImageFsInfo."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.server import listing
from cri_shim.state.records import ImageRecord

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView

log = logging.getLogger("cri_shim.server")


def _image_ref(spec: api_pb2.ImageSpec, rpc: str) -> str:
    ref = spec.image.strip()
    if not ref:
        raise InvalidArgument(f"{rpc}: no image given (ImageSpec.image is empty)")
    return ref


def _user(record: ImageRecord) -> tuple[api_pb2.Int64Value | None, str]:
    """CRI's uid/username from the config's User (`name`, `uid`, `uid:gid`, `name:group`):
    kubelet's runAsNonRoot check reads uid, and a name it cannot check."""
    user = record.user.partition(":")[0]
    if not user:
        return None, ""
    if user.isdigit():
        return api_pb2.Int64Value(value=int(user)), ""
    return None, user


def cri_image(record: ImageRecord) -> api_pb2.Image:
    uid, username = _user(record)
    image = api_pb2.Image(
        id=record.id,
        repo_tags=record.repo_tags,
        repo_digests=record.repo_digests,
        size=record.size,
        username=username,
        spec=api_pb2.ImageSpec(image=record.id),
        pinned=False,
    )
    if uid is not None:
        image.uid.CopyFrom(uid)
    return image


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


async def stream_images(
    view: ImageView, request: api_pb2.StreamImagesRequest, context: grpc.aio.ServicerContext
) -> None:
    await listing.stream(
        images_listed(view, request.filter),
        context,
        lambda image: api_pb2.StreamImagesResponse(images=[image]),
    )


async def image_status(
    view: ImageView, request: api_pb2.ImageStatusRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ImageStatusResponse:
    record = view.images.get(_image_ref(request.image, "ImageStatus"))
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


async def pull_image(
    view: ImageView, request: api_pb2.PullImageRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PullImageResponse:
    # The registry client is imported by the first pull (images/on_demand.py).
    from cri_shim.images.auth import Credentials

    ref = _image_ref(request.image, "PullImage")
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


async def remove_image(
    view: ImageView, request: api_pb2.RemoveImageRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RemoveImageResponse:
    # Any reference removes the image with every tag; an unknown image is success, since
    # kubelet's image GC may retry a removal whose answer it lost.
    await asyncio.to_thread(view.images.remove, _image_ref(request.image, "RemoveImage"))
    return api_pb2.RemoveImageResponse()


async def image_fs_info(
    view: ImageView, request: api_pb2.ImageFsInfoRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ImageFsInfoResponse:
    info = await asyncio.to_thread(view.images.fs_info)
    usage = api_pb2.FilesystemUsage(
        timestamp=time.time_ns(),
        fs_id=api_pb2.FilesystemIdentifier(mountpoint=str(info.mountpoint)),
        used_bytes=api_pb2.UInt64Value(value=info.used_bytes),
        inodes_used=api_pb2.UInt64Value(value=info.inodes_used),
    )
    return api_pb2.ImageFsInfoResponse(image_filesystems=[usage])
