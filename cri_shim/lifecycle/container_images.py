"""What a container takes from its image's record: the names reported back to kubelet,
and the configuration its spec and its stop signal are built from."""

from __future__ import annotations

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError
from cri_shim.images.reference import parse_reference
from cri_shim.runtime.spec import ImageConfigView
from cri_shim.state.records import ImageRecord


def image_names(image: ImageRecord, spec: api_pb2.ImageSpec) -> tuple[str, str]:
    """The image as the user named it, and as a repository digest reference (or "").

    kubelet names the image by its ID in `image` and passes the pod spec's name in
    `user_specified_image`; people read the name, and the digest reference, back from
    ContainerStatus (containerd reports them so too)."""
    named = spec.user_specified_image or spec.image
    hex_part = named.removeprefix("sha256:")
    if hex_part and image.id.removeprefix("sha256:").startswith(hex_part):
        named = next(iter(image.repo_tags), image.id)  # named by ID: its first tag, if any
    try:
        repository = parse_reference(named).name
    except CriError:
        repository = ""
    matching = [d for d in image.repo_digests if d.partition("@")[0] == repository]
    return named, next(iter(matching or image.repo_digests), "")


def image_config_view(image: ImageRecord | None) -> ImageConfigView:
    """The image's configuration as the spec reads it; empty for an image removed since."""
    if image is None:
        return ImageConfigView()
    return ImageConfigView(
        entrypoint=tuple(image.entrypoint),
        cmd=tuple(image.cmd),
        env=tuple(image.env),
        working_dir=image.working_dir,
        user=image.user,
        stop_signal=image.stop_signal,
    )
