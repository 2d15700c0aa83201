"""How a container's image is named back to kubelet: as the user named it, and as a
repository digest reference."""

from __future__ import annotations

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.container_images import image_names
from cri_shim.state.records import ImageRecord

ID = "sha256:" + "ab" * 32
DIGEST = "sha256:" + "cd" * 32
IMAGE = ImageRecord(
    id=ID,
    repo_tags=["127.0.0.1:5000/team/app:v1", "docker.io/library/busybox:latest"],
    repo_digests=[f"127.0.0.1:5000/team/app@{DIGEST}", f"docker.io/library/busybox@{DIGEST}"],
    size=1,
    config={},
    layers=[],
    created_at=0,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # kubelet: the ID, with the pod spec's name beside it
        (
            api_pb2.ImageSpec(image=ID, user_specified_image="busybox"),
            ("busybox", f"docker.io/library/busybox@{DIGEST}"),
        ),
        # crictl: a tag
        (
            api_pb2.ImageSpec(image="127.0.0.1:5000/team/app:v1"),
            ("127.0.0.1:5000/team/app:v1", f"127.0.0.1:5000/team/app@{DIGEST}"),
        ),
        # by ID or an ID prefix, nothing else: the first tag and its digest
        (
            api_pb2.ImageSpec(image=ID),
            ("127.0.0.1:5000/team/app:v1", f"127.0.0.1:5000/team/app@{DIGEST}"),
        ),
        (
            api_pb2.ImageSpec(image="abab"),
            ("127.0.0.1:5000/team/app:v1", f"127.0.0.1:5000/team/app@{DIGEST}"),
        ),
        # a name of another repository (the image retagged since): the first digest
        (
            api_pb2.ImageSpec(image="quay.io/x/y:z"),
            ("quay.io/x/y:z", f"127.0.0.1:5000/team/app@{DIGEST}"),
        ),
    ],
)
def test_image_names(spec: api_pb2.ImageSpec, expected: tuple[str, str]) -> None:
    assert image_names(IMAGE, spec) == expected


def test_an_imported_image_without_repo_digests_has_none() -> None:
    image = ImageRecord(ID, [], [], 1, {}, [], 0)
    assert image_names(image, api_pb2.ImageSpec(image=ID)) == (ID, "")
