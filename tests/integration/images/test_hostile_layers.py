"""Hostile layers through the real entry points: `cri-shim images import` beside a
running daemon for every case, and PullImage from docker-registry for some. The import or
pull fails naming the entry; nothing appears outside the layer; the store keeps no layer,
temporary directory or image of it; and the daemon lists no such image."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tomli_w

from cri_shim.api.v1 import api_pb2
from tests.harness import REPO, Daemon, import_command
from tests.hostile_layers import (
    HOSTILE_CASES,
    HostileCase,
    Tar,
    image_of_layers,
    store_leftovers,
    write_layout,
)
from tests.registry import RegistryServer, start_registry

pytestmark = [pytest.mark.integration, pytest.mark.root]

PULLED = (
    "symlink-chain",
    "hardlink-through-symlink",
    "char-device",
    "decompression-bomb",
    "sparse-map",
    "pax-uid",
    "pax-mtime",
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = start_registry(tmp_path_factory.mktemp("hostile-registry"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    # Short: the daemon's socket lives below it.
    path = Path(tempfile.mkdtemp(prefix="cs-h-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(base: Path, registry: RegistryServer) -> Iterator[Daemon]:
    # The limits the bomb and entry-count cases need hold for the pulls too.
    d = Daemon(
        base / "d",
        None,
        settings={
            "images": {
                "insecure_registries": [registry.host],
                "max_layer_bytes": "1MiB",
                "max_layer_entries": 10,
            }
        },
    )
    d.base.mkdir()
    d.start()
    yield d
    d.stop()


@pytest.fixture
def outside(base: Path) -> Iterator[Path]:
    """Where an escape would land: a victim file that must stay as it is."""
    directory = base / "outside"
    directory.mkdir()
    (directory / "victim").write_bytes(b"original")
    yield directory
    shutil.rmtree(directory)


def assert_nothing_left(daemon: Daemon, outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"original"
    assert (outside / "victim").stat().st_nlink == 1
    # No layer at all: the good first layer was unpacked into a temporary directory too,
    # and goes with the image it belonged to.
    assert store_leftovers(daemon.root) == []
    assert daemon.rows("images") == [] and daemon.rows("layers") == []
    listed = daemon.images().ListImages(api_pb2.ListImagesRequest(), timeout=10)
    assert list(listed.images) == []


def import_config(daemon: Daemon, case: HostileCase) -> Path:
    """The daemon's own configuration with the case's [images] settings."""
    data = tomllib.loads(daemon.config_path.read_text())
    data.setdefault("images", {}).update(case.config or {})
    path = daemon.base / f"import-{case.id}.toml"
    path.write_text(tomli_w.dumps(data))
    return path


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=[c.id for c in HOSTILE_CASES])
def test_import_of_a_hostile_layer_fails_naming_the_entry(
    daemon: Daemon, outside: Path, case: HostileCase
) -> None:
    # A harmless first layer, so that the refusal comes in the middle of an image.
    first = Tar().dir("etc").file("etc/os-release", b"hostile\n").bytes()
    image = image_of_layers([first, case.build(outside)])
    layout = write_layout(image, daemon.base / f"layout-{case.id}", f"hostile/{case.id}:v1")
    try:
        result = subprocess.run(
            import_command(import_config(daemon, case), layout),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        assert case.message in result.stderr
        assert case.entry in result.stderr
        assert "Traceback" not in result.stderr
        assert_nothing_left(daemon, outside)
    finally:
        shutil.rmtree(layout, ignore_errors=True)


@pytest.mark.parametrize("case_id", PULLED)
def test_pull_of_a_hostile_layer_fails_naming_the_entry(
    daemon: Daemon, registry: RegistryServer, outside: Path, case_id: str
) -> None:
    case = next(c for c in HOSTILE_CASES if c.id == case_id)
    image = image_of_layers([case.build(outside)])
    registry.push(f"hostile/{case.id}", image, "v1")
    request = api_pb2.PullImageRequest(
        image=api_pb2.ImageSpec(image=f"{registry.host}/hostile/{case.id}:v1")
    )
    with pytest.raises(grpc.RpcError) as info:
        daemon.images().PullImage(request, timeout=120)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert case.message in info.value.details()
    assert case.entry in info.value.details()
    assert image.layers[0].digest in info.value.details()  # which layer, for a person
    assert_nothing_left(daemon, outside)
    # The pull's layer blob is discarded with it (config and manifest blobs are small and
    # content-addressed; the layer is what could be large).
    blobs = daemon.root / "images" / "blobs" / "sha256"
    for layer in image_of_layers([case.build(outside)]).layers:
        assert not (blobs / layer.digest.removeprefix("sha256:")).exists()
    assert daemon.proc is not None and daemon.proc.poll() is None
