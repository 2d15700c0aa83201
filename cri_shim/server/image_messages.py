"""Images as the CRI reports them, and the image a request names; shared by the image RPCs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.state.records import ImageRecord

if TYPE_CHECKING:
    pass


def image_ref(spec: api_pb2.ImageSpec, rpc: str) -> str:
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
