"""ImageFsInfo: the filesystem the images are stored on, and what they use of it."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView


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
