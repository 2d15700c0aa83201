"""Overlay root filesystems from the store's layers: mount, run a shell in it, unmount."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.images.importer import import_image
from cri_shim.images.overlay import (
    PAGE_SIZE,
    mount_rootfs,
    overlay_options,
    unmount,
)
from cri_shim.images.store import ImageStore
from tests.mountinfo import is_mounted, mount_points

pytestmark = [pytest.mark.root]

CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Path]:
    """A container directory; whatever is still mounted below it is detached afterwards."""
    directory = tmp_path / "container"
    directory.mkdir()
    yield directory
    for point in reversed(mount_points()):
        if point == directory or directory in point.parents:
            unmount(point)


def sh(rootfs: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHROOT, str(rootfs), "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/bin"},
    )


def test_busybox_rootfs(store: ImageStore, busybox_layout: Path, container: Path) -> None:
    [image] = import_image(store, busybox_layout)
    rootfs, upper = container / "rootfs", container / "upper"
    mount_rootfs(store.lower_dirs(image), upper, container / "work", rootfs)
    assert is_mounted(rootfs)

    result = sh(rootfs, "echo ok")
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr

    # Layer 2 whited out one file and made /opt/opaque opaque.
    listing = sh(rootfs, "ls /etc; echo --; ls /opt/opaque; cat /etc/image-layer2").stdout
    etc, rest = listing.split("--\n")
    assert "image-layer2" in etc.split() and "removed-by-layer2" not in etc.split()
    assert rest.split() == ["new", "layer", "2"]
    assert sh(rootfs, "test -e /etc/removed-by-layer2").returncode == 1

    # Writes land in the upper directory, never in the shared layers.
    assert sh(rootfs, "echo hi > /tmp/written && rm /etc/passwd").returncode == 0
    assert (upper / "tmp/written").read_text() == "hi\n"
    assert all(not (d / "tmp/written").exists() for d in store.lower_dirs(image))
    assert (store.lower_dirs(image)[-1] / "etc/passwd").exists()

    unmount(rootfs)
    assert not is_mounted(rootfs)
    assert not (rootfs / "bin").exists()
    unmount(rootfs)  # idempotent
    unmount(container / "never-existed")


def test_readonly_rootfs(store: ImageStore, busybox_layout: Path, container: Path) -> None:
    [image] = import_image(store, busybox_layout)
    rootfs = container / "rootfs"
    mount_rootfs(store.lower_dirs(image), container / "u", container / "w", rootfs, readonly=True)
    result = sh(rootfs, "touch /tmp/x")
    assert result.returncode != 0 and "Read-only" in result.stderr
    assert sh(rootfs, "cat /etc/image-layer2").stdout == "layer 2\n"


def make_layers(base: Path, count: int, name_length: int) -> list[Path]:
    """`count` layers, bottom first, each adding `layer-<n>` and overriding `top`."""
    layers = []
    for n in range(count):
        layer = base / f"{n:04d}-{'x' * name_length}"
        layer.mkdir(parents=True)
        (layer / f"layer-{n}").write_text(str(n))
        (layer / "top").write_text(str(n))
        layers.append(layer)
    return layers


def test_long_lowerdir_uses_fd_paths(tmp_path: Path, container: Path) -> None:
    layers = make_layers(tmp_path / "layers", 120, 60)
    lower = layers[::-1]  # top first
    plain = overlay_options([str(p) for p in lower], "/u", "/w")
    assert len(plain) > PAGE_SIZE  # the case this test is about
    rootfs = container / "rootfs"
    mount_rootfs(lower, container / "upper", container / "work", rootfs)
    assert (rootfs / "layer-0").read_text() == "0"
    assert (rootfs / "layer-119").read_text() == "119"
    assert (rootfs / "top").read_text() == "119"  # the first lowerdir is the top layer
    unmount(rootfs)
    assert not is_mounted(rootfs)


def test_too_many_layers_fail_clearly(tmp_path: Path, container: Path) -> None:
    layers = make_layers(tmp_path / "layers", 300, 1)
    with pytest.raises(InvalidArgument, match="even with fd paths"):
        mount_rootfs(layers, container / "u", container / "w", container / "rootfs")
    assert not is_mounted(container / "rootfs")
    with pytest.raises(InvalidArgument, match="at most 500"):
        mount_rootfs(layers * 2, container / "u", container / "w", container / "rootfs")
    with pytest.raises(InvalidArgument, match="without layers"):
        mount_rootfs([], container / "u", container / "w", container / "rootfs")


def test_paths_overlayfs_cannot_take_are_refused(tmp_path: Path, container: Path) -> None:
    odd = tmp_path / "a:b"
    odd.mkdir()
    with pytest.raises(InvalidArgument, match="','"):
        mount_rootfs([odd], container / "u", container / "w", container / "rootfs")


def test_is_mounted_reads_escaped_mount_points(tmp_path: Path, container: Path) -> None:
    layer = make_layers(tmp_path / "layers", 1, 1)
    rootfs = container / "root fs\twith\\odd"
    mount_rootfs(layer, container / "u", container / "w", rootfs)
    assert is_mounted(rootfs)
    assert not is_mounted(container)
    unmount(rootfs)
    assert not is_mounted(rootfs)
