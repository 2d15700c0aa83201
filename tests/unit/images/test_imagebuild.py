"""The offline test-image builder: reproducible, complete, and honest about its options."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.imagebuild import (
    DEFAULT_PATH_ENV,
    build_docker_archive,
    build_image,
    build_oci_archive,
    build_oci_layout,
    busybox_applets,
    cached_oci_layout,
    digest_of,
)


def members(tar_bytes: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_builds_are_reproducible() -> None:
    assert build_image() == build_image()
    assert build_image(compression="zstd").manifest_digest == (
        build_image(compression="zstd").manifest_digest
    )
    assert build_image().image_id != build_image(user="1000").image_id


def test_base_layer_contents() -> None:
    base = members(build_image().layers[0].tar)
    assert base["bin/busybox"].mode == 0o755
    for applet in ("sh", "ls", "cat", "echo", "sleep", "id", "nc", "httpd", "ps", "env"):
        assert applet in busybox_applets()
        assert base[f"bin/{applet}"].issym() and base[f"bin/{applet}"].linkname == "busybox"
    assert base["tmp"].mode == 0o1777
    assert (base["home/app"].uid, base["home/app"].gid) == (1000, 1000)
    with tarfile.open(fileobj=io.BytesIO(build_image().layers[0].tar)) as tar:
        passwd = tar.extractfile("etc/passwd").read().decode()  # type: ignore[union-attr]
    assert "root:x:0:0:" in passwd and "app:x:1000:1000::/home/app:/bin/sh" in passwd


def test_second_layer_has_whiteouts() -> None:
    top = members(build_image().layers[1].tar)
    assert "etc/.wh.removed-by-layer2" in top
    assert "opt/opaque/.wh..wh..opq" in top
    assert "etc/image-layer2" in top


def test_config_defaults_and_overrides() -> None:
    config = build_image().config_json
    assert config["config"]["Env"] == [DEFAULT_PATH_ENV]
    assert config["config"]["Cmd"] == ["sh"]
    assert config["config"]["WorkingDir"] == "/"
    custom = build_image(
        entrypoint=["/bin/sh", "-c"], user="1000:1000", stop_signal="SIGUSR1", working_dir="/tmp"
    ).config_json["config"]
    assert custom["Entrypoint"] == ["/bin/sh", "-c"]
    assert (custom["User"], custom["StopSignal"], custom["WorkingDir"]) == (
        "1000:1000",
        "SIGUSR1",
        "/tmp",
    )
    with pytest.raises(TypeError, match="unknown"):
        build_image(nonsense=1)
    with pytest.raises(ValueError, match="zstd"):
        build_image(compression="zstd", media_types="docker")


def test_built_image_exposes_consistent_blobs() -> None:
    built = build_image(extra_files={"srv/index.html": b"hi"})
    manifest = json.loads(built.manifest)
    assert manifest["config"]["digest"] == built.config_digest == digest_of(built.config)
    assert [entry["digest"] for entry in manifest["layers"]] == [lay.digest for lay in built.layers]
    assert built.config_json["rootfs"]["diff_ids"] == [lay.diff_id for lay in built.layers]
    assert all(digest_of(data) == digest for digest, data in built.blobs.items())
    assert len(built.layers) == 3


def test_writers(tmp_path: Path) -> None:
    layout = build_oci_layout(tmp_path / "layout", tag="t1")
    index = json.loads((layout / "index.json").read_text())
    [entry] = index["manifests"]
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == (
        "docker.io/library/busybox:t1"
    )
    assert (layout / "blobs/sha256" / entry["digest"].removeprefix("sha256:")).exists()
    with tarfile.open(build_oci_archive(tmp_path / "oci.tar")) as tar:
        assert {"index.json", "oci-layout"} <= set(tar.getnames())
    with tarfile.open(build_docker_archive(tmp_path / "docker.tar", "x:1")) as tar:
        saved = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    assert saved[0]["RepoTags"] == ["x:1"] and len(saved[0]["Layers"]) == 2


def test_cached_layout_is_built_once(tmp_path: Path) -> None:
    first = cached_oci_layout(tmp_path)
    assert cached_oci_layout(tmp_path) == first
    assert cached_oci_layout(tmp_path, tag="other") != first
