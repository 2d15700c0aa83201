"""Importing the busybox test image from an OCI layout, an OCI archive and a docker-archive."""

from __future__ import annotations

import json
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.images.content import DigestMismatch
from cri_shim.images.importer import import_image
from cri_shim.images.manifest import host_platform
from cri_shim.images.store import ImageStore
from tests.imagebuild import (
    DEFAULT_REF_NAME,
    BuiltImage,
    Compression,
    build_docker_archive,
    build_image,
    build_oci_archive,
    build_oci_layout,
    digest_of,
    layout_files,
)

pytestmark = [pytest.mark.root]  # the image's layers hold whiteouts and files owned by 1000

BUSYBOX = f"{DEFAULT_REF_NAME}:latest"


def assert_busybox_unpacked(store: ImageStore, image_id: str) -> None:
    image = store.resolve(image_id)
    bottom, top = store.lower_dirs(image)[::-1]
    assert (bottom / "bin/busybox").stat().st_mode & stat.S_IXUSR
    assert (bottom / "bin/sh").readlink() == Path("busybox")
    assert (bottom / "home/app").stat().st_uid == 1000
    whiteout = (top / "etc/removed-by-layer2").lstat()
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert (top / "etc/image-layer2").read_text() == "layer 2\n"


def test_oci_layout(store: ImageStore, busybox_layout: Path) -> None:
    built = build_image()
    [image] = import_image(store, busybox_layout)
    assert image.id == built.image_id
    assert image.repo_tags == [BUSYBOX]
    assert image.repo_digests == [f"{DEFAULT_REF_NAME}@{built.manifest_digest}"]
    assert image.manifest_digest == built.manifest_digest
    assert store.read_blob(built.manifest_digest) == built.manifest
    assert image.cmd == ["sh"] and image.env[0].startswith("PATH=")
    assert_busybox_unpacked(store, "busybox")
    assert store.resolve(f"busybox@{built.manifest_digest}").id == image.id


def test_import_twice_is_idempotent(store: ImageStore, busybox_layout: Path) -> None:
    [first] = import_image(store, busybox_layout)
    [again] = import_image(store, busybox_layout)
    assert again.id == first.id and again.repo_tags == first.repo_tags
    assert len(store.list()) == 1


def test_name_overrides_the_annotation(store: ImageStore, busybox_layout: Path) -> None:
    [image] = import_image(store, busybox_layout, "localhost/mine:v1")
    assert image.repo_tags == ["localhost/mine:v1"]
    assert image.repo_digests == [f"localhost/mine@{image.manifest_digest}"]


def test_bare_tag_annotation_combines_with_name(store: ImageStore, tmp_path: Path) -> None:
    layout = build_oci_layout(tmp_path / "layout", tag="1.36", ref_name="")  # skopeo style
    [image] = import_image(store, layout, "quay.io/test/busybox")
    assert image.repo_tags == ["quay.io/test/busybox:1.36"]


def test_bare_tag_without_name_imports_untagged(store: ImageStore, tmp_path: Path) -> None:
    layout = build_oci_layout(tmp_path / "layout", tag="1.36", ref_name="")
    [image] = import_image(store, layout)
    assert image.repo_tags == [] and store.resolve(image.id) == image


def test_containerd_name_annotation(store: ImageStore, tmp_path: Path) -> None:
    built = build_image()
    files = layout_files(built, "v9", containerd_name="registry.local/team/bb:v9")
    write(tmp_path / "layout", files)
    [image] = import_image(store, tmp_path / "layout")
    assert image.repo_tags == ["registry.local/team/bb:v9"]


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
def test_oci_archive(store: ImageStore, tmp_path: Path, compression: Compression) -> None:
    archive = build_oci_archive(tmp_path / "image.tar", compression=compression)
    [image] = import_image(store, archive)
    assert image.id == build_image().image_id  # the config names diff IDs, not blobs
    assert image.repo_tags == [BUSYBOX]
    assert_busybox_unpacked(store, image.id)
    assert list(store.tmp_dir.iterdir()) == []


def test_docker_media_types_in_a_layout(store: ImageStore, tmp_path: Path) -> None:
    layout = build_oci_layout(tmp_path / "layout", media_types="docker")
    [image] = import_image(store, layout)
    assert image.manifest_digest == build_image(media_types="docker").manifest_digest
    assert_busybox_unpacked(store, image.id)


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_docker_archive(store: ImageStore, tmp_path: Path, compression: Compression) -> None:
    archive = build_docker_archive(
        tmp_path / "saved.tar", "example.com/app:2", compression=compression, user="1000"
    )
    [image] = import_image(store, archive)
    assert image.repo_tags == ["example.com/app:2"]
    assert image.repo_digests == [] and image.manifest_digest == ""  # as `docker load`
    assert image.user == "1000"
    assert_busybox_unpacked(store, "example.com/app:2")
    [renamed] = import_image(store, archive, "other:1")
    assert renamed.id == image.id
    assert store.resolve("other:1").id == image.id


def test_docker_archive_with_symlinked_layer(store: ImageStore, tmp_path: Path) -> None:
    """Older `docker save` stores a repeated layer once and links the other copies."""
    built = build_image(compression="none", media_types="docker")
    first = built.layers[0]
    # An image whose two layers are the same: the second entry is a symlink.
    config = json.loads(built.config)
    config["rootfs"]["diff_ids"] = [first.diff_id, first.diff_id]
    config_bytes = json.dumps(config).encode()
    archive = tmp_path / "linked.tar"
    with tarfile.open(archive, "w") as tar:
        add_bytes(tar, "cfg.json", config_bytes)
        add_bytes(tar, "one/layer.tar", first.data)
        link = tarfile.TarInfo("two/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, "../one/layer.tar"
        tar.addfile(link)
        manifest = [
            {
                "Config": "cfg.json",
                "RepoTags": ["dup:1"],
                "Layers": ["one/layer.tar", "two/layer.tar"],
            }
        ]
        add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    [image] = import_image(store, archive)
    assert len(image.layers) == 2 and image.layers[0] != image.layers[1]


def test_nested_index_picks_the_host_platform(store: ImageStore, tmp_path: Path) -> None:
    built = build_image()
    other = build_image(labels={"arch": "other"})
    files = layout_files(built, None)
    files.update(layout_files(other, None))
    here = host_platform()
    nested = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            descriptor(other, {"os": "linux", "architecture": "s390x"}),
            descriptor(built, {"os": here.os, "architecture": here.architecture}),
        ],
    }
    nested_bytes = json.dumps(nested).encode()
    files[f"blobs/sha256/{digest_of(nested_bytes)[7:]}"] = nested_bytes
    files["index.json"] = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.index.v1+json",
                    "digest": digest_of(nested_bytes),
                    "size": len(nested_bytes),
                    "annotations": {"org.opencontainers.image.ref.name": "multi.example/bb:1"},
                }
            ],
        }
    ).encode()
    write(tmp_path / "layout", files)
    [image] = import_image(store, tmp_path / "layout")
    assert image.id == built.image_id
    assert image.repo_tags == ["multi.example/bb:1"]
    assert image.repo_digests == [f"multi.example/bb@{built.manifest_digest}"]


def test_no_image_for_this_platform(store: ImageStore, tmp_path: Path) -> None:
    built = build_image()
    files = layout_files(built, "x:1")
    index = json.loads(files["index.json"])
    index["manifests"][0]["platform"] = {"os": "linux", "architecture": "s390x"}
    if host_platform().architecture == "s390x":
        index["manifests"][0]["platform"]["architecture"] = "riscv64"
    files["index.json"] = json.dumps(index).encode()
    write(tmp_path / "layout", files)
    with pytest.raises(InvalidArgument, match="no image for platform"):
        import_image(store, tmp_path / "layout")


def test_corrupted_layer_is_refused(
    store: ImageStore, tmp_path: Path, busybox_layout: Path
) -> None:
    layout = tmp_path / "layout"
    shutil.copytree(busybox_layout, layout)
    top = build_image().layers[-1]
    blob = layout / "blobs/sha256" / top.digest.removeprefix("sha256:")
    data = bytearray(blob.read_bytes())
    data[-20] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch):
        import_image(store, layout)
    assert store.list() == []


def test_corrupted_manifest_is_refused(
    store: ImageStore, tmp_path: Path, busybox_layout: Path
) -> None:
    layout = tmp_path / "layout"
    shutil.copytree(busybox_layout, layout)
    manifest = layout / "blobs/sha256" / build_image().manifest_digest.removeprefix("sha256:")
    manifest.write_bytes(manifest.read_bytes().replace(b"schemaVersion", b"schemaversion"))
    with pytest.raises(InvalidArgument, match="does not match its digest"):
        import_image(store, layout)


def test_not_an_image(store: ImageStore, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="not an image"):
        import_image(store, tmp_path / "empty")
    (tmp_path / "text").write_text("hello")
    with pytest.raises(InvalidArgument, match="neither"):
        import_image(store, tmp_path / "text")
    with pytest.raises(InvalidArgument, match="does not exist"):
        import_image(store, tmp_path / "missing")
    with pytest.raises(InvalidArgument):
        import_image(store, tmp_path / "empty", "bad@sha256:" + "a" * 64)


def test_archive_paths_cannot_leave_the_archive(store: ImageStore, tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        manifest = [{"Config": "../../etc/passwd", "RepoTags": ["x:1"], "Layers": []}]
        add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    with pytest.raises(InvalidArgument, match="outside the archive"):
        import_image(store, archive)


def test_shared_layers_are_not_copied_again(store: ImageStore, tmp_path: Path) -> None:
    import_image(store, build_oci_layout(tmp_path / "a"))
    calls: list[str | None] = []
    original = store.put_blob

    def counting_put_blob(content, expected_digest=None, expected_size=None):  # type: ignore[no-untyped-def]
        calls.append(expected_digest)
        return original(content, expected_digest, expected_size)

    store.put_blob = counting_put_blob  # type: ignore[method-assign]
    extra = build_oci_layout(tmp_path / "b", "extra", extra_files={"etc/extra": b"3rd layer"})
    [image] = import_image(store, extra)
    built = build_image(extra_files={"etc/extra": b"3rd layer"})
    layer_digests = {layer.digest for layer in built.layers}
    assert layer_digests & set(calls) == {built.layers[2].digest}
    assert len(image.layers) == 3
    assert len([p for p in store.layers_dir.iterdir()]) == 3


# --- helpers -----------------------------------------------------------------------------
def write(dest: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def descriptor(image: BuiltImage, platform: dict[str, str]) -> dict[str, object]:
    return {
        "mediaType": image.manifest_media_type,
        "digest": image.manifest_digest,
        "size": len(image.manifest),
        "platform": platform,
    }


def test_name_without_tag_keeps_the_files_tag(store: ImageStore, tmp_path: Path) -> None:
    layout = build_oci_layout(tmp_path / "layout", tag="t5")  # ref.name docker.io/…/busybox:t5
    [image] = import_image(store, layout, "quay.io/x")
    assert image.repo_tags == ["quay.io/x:t5"]
