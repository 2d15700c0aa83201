"""Image volumes (Mount.image, image_sub_path) against the real daemon: an image's files
visible read-only in a container, writes refused, its binaries runnable, its digest
reported."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, userns_linux, wait_until
from tests.imagebuild import build_oci_layout
from tests.integration.cri_testkit import (
    container_config,
    create,
    import_image,
    output,
    pod,
    remove,
    run_to_exit,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

VOLUME_IMAGE = "docker.io/library/artifacts:1"


@pytest.fixture
def volume_image_id(daemon: Daemon, busybox_layout: Path, short_tmp: Path) -> str:
    """The busybox image for containers, and an image of data files for volumes."""
    import_image(daemon, busybox_layout)
    layout = build_oci_layout(
        short_tmp / "artifacts",
        tag="1",
        ref_name=VOLUME_IMAGE,
        extra_files={
            "data/hello.txt": b"hello from the image\n",
            "data/nested/deep.txt": b"deep\n",
        },
    )
    import_image(daemon, layout, VOLUME_IMAGE)
    status = daemon.images().ImageStatus(
        api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=VOLUME_IMAGE)), timeout=10
    )
    return str(status.image.id)


def _volume(image: str, sub_path: str = "", readonly: bool = True) -> api_pb2.Mount:
    return api_pb2.Mount(
        container_path="/vol",
        image=api_pb2.ImageSpec(image=image),
        image_sub_path=sub_path,
        readonly=readonly,
    )


def test_an_image_volume_is_visible_read_only_and_executable(
    daemon: Daemon, volume_image_id: str, short_tmp: Path
) -> None:
    script = (
        "cat /vol/data/hello.txt; "
        "touch /vol/new 2>/dev/null && echo written || echo write-refused; "
        "/vol/bin/busybox true 2>/dev/null && echo executed || echo exec-refused"
    )
    with pod(daemon, "imgvol", short_tmp) as p:
        # kubelet sends the image reference PullImage returned (the image ID).
        st = run_to_exit(
            daemon, p, container_config("whole", script, mounts=[_volume(volume_image_id)])
        )
        # Kubernetes lets a container run binaries from an image volume.
        assert output(st) == ["hello from the image", "write-refused", "executed"]
        (mount,) = st.mounts
        assert mount.image.image == volume_image_id  # the digest, for kubelet's status
        assert mount.image.image_ref == volume_image_id  # where CRI 1.36 reads it
        assert mount.readonly and mount.container_path == "/vol"
    assert daemon.leaks() == {}


def test_a_sub_path_mounts_only_that_directory(
    daemon: Daemon, volume_image_id: str, short_tmp: Path
) -> None:
    with pod(daemon, "subpath", short_tmp) as p:
        # A tag works as well as the ID; the status reports the ID it resolved to.
        st = run_to_exit(
            daemon,
            p,
            container_config(
                "sub", "ls /vol; cat /vol/nested/deep.txt", mounts=[_volume(VOLUME_IMAGE, "data")]
            ),
        )
        assert output(st) == ["hello.txt", "nested", "deep"]
        assert st.mounts[0].image.image == st.mounts[0].image.image_ref == volume_image_id
        assert st.mounts[0].image.user_specified_image == VOLUME_IMAGE


def test_the_volume_outlives_the_removal_of_its_image(
    daemon: Daemon, volume_image_id: str, short_tmp: Path
) -> None:
    with pod(daemon, "outlive", short_tmp) as p:
        config = container_config(
            "reader", "sleep 2; cat /vol/hello.txt", mounts=[_volume(volume_image_id, "data")]
        )
        container_id = create(daemon, p, config)
        daemon.runtime().StartContainer(
            api_pb2.StartContainerRequest(container_id=container_id), timeout=30
        )
        daemon.images().RemoveImage(
            api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=volume_image_id)), timeout=30
        )
        st = run_to_exit_existing(daemon, container_id)
        assert output(st) == ["hello from the image"]
        remove(daemon, container_id)
    assert daemon.leaks() == {}


def run_to_exit_existing(daemon: Daemon, container_id: str) -> api_pb2.ContainerStatus:
    def exited() -> api_pb2.ContainerStatus | None:
        st = (
            daemon.runtime()
            .ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id), timeout=10)
            .status
        )
        return st if st.state == api_pb2.CONTAINER_EXITED else None

    return wait_until(exited, timeout=20)


@pytest.mark.parametrize(
    ("mount", "code", "complaint"),
    [
        (_volume("IMAGE", readonly=False), grpc.StatusCode.INVALID_ARGUMENT, "always read-only"),
        (_volume("IMAGE", "missing"), grpc.StatusCode.INVALID_ARGUMENT, "does not exist"),
        (_volume("IMAGE", "../etc"), grpc.StatusCode.INVALID_ARGUMENT, "relative path inside"),
        (_volume("docker.io/library/absent:1"), grpc.StatusCode.NOT_FOUND, "pull it first"),
    ],
)
def test_a_volume_that_cannot_be_honoured_is_refused_and_leaves_nothing(
    daemon: Daemon,
    volume_image_id: str,
    short_tmp: Path,
    mount: api_pb2.Mount,
    code: grpc.StatusCode,
    complaint: str,
) -> None:
    if mount.image.image == "IMAGE":
        mount.image.image = volume_image_id
    with pod(daemon, "refused", short_tmp) as p:
        with pytest.raises(grpc.RpcError) as failure:
            create(daemon, p, container_config("bad", "true", mounts=[mount]))
        assert failure.value.code() == code
        assert complaint in failure.value.details()
        assert "mounts[0]" in failure.value.details()
    assert daemon.leaks() == {}


def test_an_image_volume_in_a_user_namespaced_pod_belongs_to_its_root(
    daemon: Daemon, volume_image_id: str, short_tmp: Path
) -> None:
    """The volume's layers are idmapped like the root filesystem's: the host root's files
    are the pod root's, not nobody's."""
    linux = userns_linux(65536 * 3200)
    script = "stat -c '%u %g' /vol/data/hello.txt; cat /vol/data/hello.txt"
    with pod(daemon, "imgvol-userns", short_tmp, linux=linux) as p:
        st = run_to_exit(
            daemon, p, container_config("owned", script, mounts=[_volume(volume_image_id)])
        )
        assert output(st) == ["0 0", "hello from the image"]
    assert daemon.leaks() == {}
