"""PullImage and the rest of the ImageService against Debian's docker-registry on 127.0.0.1,
through the real daemon: tags, digests, mirrors, indexes, compressions, shared downloads
counted at the registry, corruption, errors, and a container run from a pulled image."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.images.manifest import Platform, host_platform
from tests.crilog import join_partials, read_records
from tests.harness import Daemon, pod_config, wait_until
from tests.imagebuild import BuiltImage, build_image
from tests.registry import DOCKER_LIST, RegistryServer, free_port, start_registry

pytestmark = [pytest.mark.integration, pytest.mark.root]

HOST = host_platform()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = start_registry(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


def start_daemon(base: Path, registry: RegistryServer, **images: object) -> Daemon:
    settings = {"images": {"insecure_registries": [registry.host], **images}}
    daemon = Daemon(base, None, settings=settings)
    daemon.start()
    return daemon


@pytest.fixture
def daemon(short_tmp: Path, registry: RegistryServer) -> Iterator[Daemon]:
    d = start_daemon(short_tmp, registry)
    yield d
    d.stop()


def spec(image: str) -> api_pb2.ImageSpec:
    return api_pb2.ImageSpec(image=image)


def pull(daemon: Daemon, image: str, auth: api_pb2.AuthConfig | None = None) -> str:
    request = api_pb2.PullImageRequest(image=spec(image), auth=auth)
    return str(daemon.images().PullImage(request, timeout=120).image_ref)


def status(daemon: Daemon, image: str, verbose: bool = False) -> api_pb2.ImageStatusResponse:
    request = api_pb2.ImageStatusRequest(image=spec(image), verbose=verbose)
    response: api_pb2.ImageStatusResponse = daemon.images().ImageStatus(request, timeout=10)
    return response


def pull_error(daemon: Daemon, image: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        pull(daemon, image)
    return info.value


def layer_blobs_in_store(daemon: Daemon, image: BuiltImage) -> list[str]:
    blobs = daemon.root / "images" / "blobs" / "sha256"
    return [x.digest for x in image.layers if (blobs / x.digest.removeprefix("sha256:")).exists()]


# --- pulls and what the ImageService shows ----------------------------------------------
def test_pull_by_tag_then_status_list_fsinfo_and_remove(
    daemon: Daemon, registry: RegistryServer
) -> None:
    image = build_image(user="1000", extra_files={"etc/which": b"by-tag"})
    manifest_digest = registry.push("team/app", image, "v1")
    name = f"{registry.host}/team/app"
    before = daemon.images().ImageFsInfo(api_pb2.ImageFsInfoRequest(), timeout=10)

    assert pull(daemon, f"{name}:v1") == image.image_id

    by_tag = status(daemon, f"{name}:v1").image
    assert by_tag.id == image.image_id
    assert list(by_tag.repo_tags) == [f"{name}:v1"]
    assert list(by_tag.repo_digests) == [f"{name}@{manifest_digest}"]
    assert by_tag.uid.value == 1000 and by_tag.username == ""
    assert by_tag.size > 1_000_000 and not by_tag.pinned
    assert status(daemon, f"{name}@{manifest_digest}").image.id == image.image_id
    assert status(daemon, image.image_id).image.id == image.image_id
    verbose = status(daemon, f"{name}:v1", verbose=True)
    info = json.loads(verbose.info["info"])
    assert info["imageSpec"]["config"]["User"] == "1000" and len(info["layers"]) == 3

    listed = daemon.images().ListImages(api_pb2.ListImagesRequest(), timeout=10).images
    assert [i.id for i in listed] == [image.image_id]
    filtered = (
        daemon.images()
        .ListImages(
            api_pb2.ListImagesRequest(filter=api_pb2.ImageFilter(image=spec(name))), timeout=10
        )
        .images
    )
    assert [i.id for i in filtered] == [image.image_id]
    other = api_pb2.ListImagesRequest(filter=api_pb2.ImageFilter(image=spec(f"{name}:v9")))
    assert list(daemon.images().ListImages(other, timeout=10).images) == []

    after = daemon.images().ImageFsInfo(api_pb2.ImageFsInfoRequest(), timeout=10)
    [fs] = after.image_filesystems
    assert fs.fs_id.mountpoint == str(daemon.root / "images")
    assert fs.used_bytes.value > before.image_filesystems[0].used_bytes.value + 1_000_000
    assert fs.inodes_used.value > 100

    # By digest: the image goes with all its names, and its layers with it.
    layer_dirs = [p for p in (daemon.root / "images" / "layers").iterdir()]
    assert len(layer_dirs) == 3
    daemon.images().RemoveImage(
        api_pb2.RemoveImageRequest(image=spec(f"{name}@{manifest_digest}")), timeout=30
    )
    assert not status(daemon, f"{name}:v1").HasField("image")
    assert not status(daemon, image.image_id).HasField("image")
    assert list((daemon.root / "images" / "layers").iterdir()) == []
    # Removing what is not there is success (kubelet retries removals).
    daemon.images().RemoveImage(api_pb2.RemoveImageRequest(image=spec(f"{name}:v1")), timeout=30)


def test_username_from_a_named_user(daemon: Daemon, registry: RegistryServer) -> None:
    image = build_image(user="app:app", extra_files={"etc/which": b"named"})
    registry.push("team/named", image, "v1")
    pull(daemon, f"{registry.host}/team/named:v1")
    found = status(daemon, f"{registry.host}/team/named:v1").image
    assert found.username == "app" and not found.HasField("uid")


def test_pull_by_digest_and_a_second_tag_name_one_image(
    daemon: Daemon, registry: RegistryServer
) -> None:
    image = build_image(extra_files={"etc/which": b"two-tags"})
    digest = registry.push("team/tags", image, "v1")
    registry.push("team/tags", image, "stable")
    name = f"{registry.host}/team/tags"

    assert pull(daemon, f"{name}@{digest}") == image.image_id
    assert list(status(daemon, f"{name}@{digest}").image.repo_tags) == []
    registry.mark()
    pull(daemon, f"{name}:v1")
    pull(daemon, f"{name}:stable")
    assert registry.blob_gets() == []  # every layer was unpacked already
    images = daemon.images().ListImages(api_pb2.ListImagesRequest(), timeout=10).images
    assert len(images) == 1
    assert sorted(images[0].repo_tags) == [f"{name}:stable", f"{name}:v1"]
    assert list(images[0].repo_digests) == [f"{name}@{digest}"]


def test_short_name_through_a_docker_io_mirror(short_tmp: Path, registry: RegistryServer) -> None:
    image = build_image(extra_files={"etc/which": b"mirrored"})
    digest = registry.push("library/busybox", image, "latest")
    dead = f"http://127.0.0.1:{free_port()}"
    daemon = start_daemon(short_tmp, registry, mirrors={"docker.io": [dead, registry.url]})
    try:
        assert pull(daemon, "busybox") == image.image_id
        found = status(daemon, "busybox").image
        # The image keeps its own name, not the mirror's.
        assert list(found.repo_tags) == ["docker.io/library/busybox:latest"]
        assert list(found.repo_digests) == [f"docker.io/library/busybox@{digest}"]
        log = daemon.log_path.read_text()
        assert f"mirror {dead} failed" in log
        assert "registry-1.docker.io" not in log  # no need to go past the mirrors
    finally:
        daemon.stop()


def test_index_with_several_platforms_fetches_only_this_one(
    daemon: Daemon, registry: RegistryServer
) -> None:
    others = [Platform("linux", a) for a in ("s390x", "ppc64le", "riscv64")]
    others = [p for p in others if p.architecture != HOST.architecture][:2]
    images = [(build_image(extra_files={"etc/arch": str(p).encode()}), p) for p in others]
    mine = build_image(extra_files={"etc/arch": b"mine"})
    images.insert(1, (mine, HOST))

    def as_dict(p: Platform) -> dict[str, str]:
        variant = {"variant": p.variant} if p.variant else {}
        return {"os": p.os, "architecture": p.architecture, **variant}

    for index_type, repository in ((None, "multi/oci"), (DOCKER_LIST, "multi/docker")):
        kwargs = {"media_type": index_type} if index_type else {}
        index_digest = registry.push_index(
            repository, [(i, as_dict(p)) for i, p in images], "v1", **kwargs
        )
        registry.mark()
        name = f"{registry.host}/{repository}"
        assert pull(daemon, f"{name}:v1") == mine.image_id
        assert f"{name}@{index_digest}" in status(daemon, f"{name}:v1").image.repo_digests
        fetched = set(registry.blob_gets()) | set(registry.manifest_gets())
        for other, _platform in images:
            if other is not mine:
                assert other.manifest_digest not in fetched
                assert other.config_digest not in fetched
                assert other.layers[2].digest not in fetched
        assert mine.manifest_digest in fetched


@pytest.mark.parametrize(
    ("compression", "media_types"), [("gzip", "oci"), ("zstd", "oci"), ("none", "docker")]
)
def test_layer_compressions(
    daemon: Daemon, registry: RegistryServer, compression: str, media_types: str
) -> None:
    image = build_image(
        compression=compression,  # type: ignore[arg-type]
        media_types=media_types,  # type: ignore[arg-type]
        extra_files={"etc/compression": compression.encode()},
    )
    registry.push(f"comp/{compression}", image, "v1")
    assert pull(daemon, f"{registry.host}/comp/{compression}:v1") == image.image_id
    layers = sorted((daemon.root / "images" / "layers").iterdir())
    found = [p for p in layers if (p / "diff" / "etc" / "compression").exists()]
    assert [p.joinpath("diff/etc/compression").read_text() for p in found] == [compression]


# --- shared downloads --------------------------------------------------------------------
def test_concurrent_pulls_fetch_each_blob_once(daemon: Daemon, registry: RegistryServer) -> None:
    big = os.urandom(8 << 20)  # enough that the pulls overlap
    first = build_image(extra_files={"data/big": big, "etc/which": b"one"})
    second = build_image(extra_files={"data/big": big, "etc/which": b"two"})
    registry.push("shared/one", first, "v1")
    registry.push("shared/one", first, "v2")
    registry.push("shared/two", second, "v1")
    registry.mark()
    refs = [f"{registry.host}/shared/one:v1"] * 3 + [f"{registry.host}/shared/one:v2"] * 2
    refs += [f"{registry.host}/shared/two:v1"] * 3
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int, ref: str) -> None:
        try:
            results[i] = pull(daemon, ref)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(refs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {results[i] for i in range(5)} == {first.image_id}
    assert {results[i] for i in range(5, 8)} == {second.image_id}

    gets = registry.blob_gets()
    # The two base layers are shared by both images: fetched once for all eight pulls.
    wanted = {first.config_digest, second.config_digest}
    wanted |= {x.digest for x in first.layers} | {x.digest for x in second.layers}
    assert sorted(gets) == sorted(wanted), f"blob GETs at the registry: {gets}"
    one = status(daemon, f"{registry.host}/shared/one:v1").image
    name = f"{registry.host}/shared/one"
    assert sorted(one.repo_tags) == [f"{name}:v1", f"{name}:v2"]


@pytest.mark.slow
def test_kill_during_a_pull_leaves_no_partial_blob_and_the_pull_resumes(
    short_tmp: Path, registry: RegistryServer
) -> None:
    big = os.urandom(96 << 20)
    image = build_image(compression="none", media_types="docker", extra_files={"data/big": big})
    registry.push("resume/app", image, "v1")
    daemon = start_daemon(short_tmp, registry)
    ref = f"{registry.host}/resume/app:v1"
    tmp = daemon.root / "images" / "tmp"
    try:
        outcome: list[BaseException | str] = []

        def doomed_pull() -> None:
            try:
                outcome.append(pull(daemon, ref))
            except grpc.RpcError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=doomed_pull)
        thread.start()
        for _ in range(2000):
            if any(tmp.iterdir()):
                break
            threading.Event().wait(0.002)
        assert any(tmp.iterdir()), "the pull never started writing a blob"
        daemon.kill9()
        thread.join()
        assert isinstance(outcome[0], grpc.RpcError)  # the daemon died under it
        assert any(tmp.iterdir())  # a dead writer's temporary file, never a blob
        big_blob = image.layers[2].digest
        assert big_blob not in layer_blobs_in_store(daemon, image)

        daemon.start()
        assert list(tmp.iterdir()) == []  # removed at start: its writer is dead
        registry.mark()
        assert pull(daemon, ref) == image.image_id
        assert status(daemon, ref).image.id == image.image_id
    finally:
        daemon.stop()


# --- failures ------------------------------------------------------------------------------
def test_corrupted_blob_fails_the_pull_and_keeps_nothing(
    daemon: Daemon, registry: RegistryServer
) -> None:
    image = build_image(extra_files={"etc/which": b"corrupt"})
    registry.push("bad/corrupt", image, "v1")
    registry.corrupt_blob(image.layers[2].digest)
    error = pull_error(daemon, f"{registry.host}/bad/corrupt:v1")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert image.layers[2].digest in error.details() and "hashes to" in error.details()
    assert list(daemon.images().ListImages(api_pb2.ListImagesRequest(), timeout=10).images) == []
    assert layer_blobs_in_store(daemon, image) == []
    assert list((daemon.root / "images" / "tmp").iterdir()) == []
    assert list((daemon.root / "images" / "layers").iterdir()) == []


def test_unknown_tag_and_repository_are_not_found(daemon: Daemon, registry: RegistryServer) -> None:
    registry.push("known/app", build_image(), "v1")
    for ref in (f"{registry.host}/known/app:nope", f"{registry.host}/unknown/app:v1"):
        error = pull_error(daemon, ref)
        assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
        assert f"image {ref} not found" in error.details()


def test_invalid_reference_is_invalid_argument(daemon: Daemon) -> None:
    for ref in ("library/Upper:v1", "app:bad tag", "app@sha256:short", "app:-v1", ""):
        error = pull_error(daemon, ref)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (ref, error.details())


def test_unreachable_registry_is_unavailable_naming_the_endpoint(short_tmp: Path) -> None:
    port = free_port()
    settings = {"images": {"insecure_registries": [f"127.0.0.1:{port}"]}}
    daemon = Daemon(short_tmp, None, settings=settings)
    daemon.start()
    try:
        error = pull_error(daemon, f"127.0.0.1:{port}/app:v1")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"http://127.0.0.1:{port} is unreachable" in error.details()
    finally:
        daemon.stop()


def test_https_unless_listed_as_insecure(short_tmp: Path, registry: RegistryServer) -> None:
    registry.push("tls/app", build_image(), "v1")
    daemon = Daemon(short_tmp, None)
    daemon.start()
    try:
        error = pull_error(daemon, f"{registry.host}/tls/app:v1")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"https://{registry.host}" in error.details()
        assert "insecure_registries" in error.details()
    finally:
        daemon.stop()


# --- a pulled image in use --------------------------------------------------------------------
def run_in_pod(
    daemon: Daemon, ref: str | api_pb2.ImageSpec, logs: Path, script: str
) -> tuple[str, api_pb2.ContainerStatus]:
    """Run `script` in a container of `ref` in a new pod; the pod's ID and the exited
    container's status."""
    config = pod_config("pulled", uid="pulled-1", log_directory=str(logs))
    runtime = daemon.runtime()
    sandbox_id = runtime.RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=config), timeout=60
    ).pod_sandbox_id
    container = api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name="app"),
        image=spec(ref) if isinstance(ref, str) else ref,
        command=["/bin/sh", "-c"],
        args=[script],
        log_path="app.log",
    )
    container_id = runtime.CreateContainer(
        api_pb2.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=container, sandbox_config=config
        ),
        timeout=60,
    ).container_id
    runtime.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=30)
    request = api_pb2.ContainerStatusRequest(container_id=container_id)
    final = wait_until(
        lambda: (
            (s := runtime.ContainerStatus(request, timeout=10).status).state
            == api_pb2.CONTAINER_EXITED
            and s
        ),
        timeout=30,
    )
    return sandbox_id, final


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )


def test_a_container_runs_from_a_pulled_image(
    make_daemon: Callable[..., Daemon], registry: RegistryServer, short_tmp: Path
) -> None:
    image = build_image(extra_files={"etc/greeting": b"hello from the registry\n"})
    manifest_digest = registry.push("run/app", image, "v1")
    ref = f"{registry.host}/run/app:v1"
    daemon = make_daemon(settings={"images": {"insecure_registries": [registry.host]}})
    daemon.start()
    assert pull(daemon, ref) == image.image_id
    script = "cat /etc/greeting; cat /etc/image-layer2; test ! -e /etc/removed-by-layer2"
    sandbox_id, final = run_in_pod(daemon, ref, short_tmp / "logs", script)
    try:
        assert final.exit_code == 0
        assert final.image.image == ref
        assert final.image_ref == f"{registry.host}/run/app@{manifest_digest}"
        assert final.image_id == image.image_id
        lines = [m.content.decode() for m in join_partials(read_records(Path(final.log_path)))]
        assert lines == ["hello from the registry", "layer 2"]
    finally:
        remove_pod(daemon, sandbox_id)


def test_a_container_named_by_image_id_reports_the_pod_specs_name_and_repo_digest(
    make_daemon: Callable[..., Daemon], registry: RegistryServer, short_tmp: Path
) -> None:
    # kubelet's CreateContainer: the image by ID, the pod spec's name beside it. kubelet
    # shows ContainerStatus's `image` and `image_ref` as the pod's image and imageID.
    image = build_image(extra_files={"etc/which": b"by-id"})
    registry.push("other/app", image, "v0")
    manifest_digest = registry.push("run/named", image, "v2")
    ref = f"{registry.host}/run/named:v2"
    daemon = make_daemon(settings={"images": {"insecure_registries": [registry.host]}})
    daemon.start()
    pull(daemon, f"{registry.host}/other/app:v0")
    assert pull(daemon, ref) == image.image_id
    by_id = api_pb2.ImageSpec(image=image.image_id, user_specified_image=ref)
    sandbox_id, final = run_in_pod(daemon, by_id, short_tmp / "logs", "true")
    try:
        expected = (ref, ref, f"{registry.host}/run/named@{manifest_digest}", image.image_id)
        assert (
            final.image.image,
            final.image.user_specified_image,
            final.image_ref,
            final.image_id,
        ) == expected
        request = api_pb2.ListContainersRequest(
            filter=api_pb2.ContainerFilter(pod_sandbox_id=sandbox_id)
        )
        (listed,) = daemon.runtime().ListContainers(request, timeout=10).containers
        assert (
            listed.image.image,
            listed.image.user_specified_image,
            listed.image_ref,
            listed.image_id,
        ) == expected
    finally:
        remove_pod(daemon, sandbox_id)


def test_removing_a_pulled_image_keeps_the_layers_a_container_uses(
    make_daemon: Callable[..., Daemon], registry: RegistryServer, short_tmp: Path
) -> None:
    image = build_image(extra_files={"etc/greeting": b"still here"})
    registry.push("run/kept", image, "v1")
    ref = f"{registry.host}/run/kept:v1"
    daemon = make_daemon(settings={"images": {"insecure_registries": [registry.host]}})
    daemon.start()
    pull(daemon, ref)
    sandbox_id, _final = run_in_pod(daemon, ref, short_tmp / "logs", "true")
    layers = daemon.root / "images" / "layers"
    try:
        before = sorted(p.name for p in layers.iterdir())
        daemon.images().RemoveImage(api_pb2.RemoveImageRequest(image=spec(ref)), timeout=30)
        assert not status(daemon, ref).HasField("image")
        assert sorted(p.name for p in layers.iterdir()) == before
    finally:
        remove_pod(daemon, sandbox_id)
    # the last container using them is gone: now the layers are collected
    assert sorted(p.name for p in layers.iterdir()) == []
