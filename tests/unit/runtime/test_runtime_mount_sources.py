"""Bind-mount sources resolved once: after the pin, swapping the host path (a
symlink re-pointed, a directory renamed) no longer changes what a mount gets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.host import mounts
from cri_shim.runtime.mount_sources import pin_bind_sources

pytestmark = [pytest.mark.root]  # bind mounts


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Path]:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "which").write_text(name)
    (tmp_path / "file-a").write_text("file a")
    (tmp_path / "file-b").write_text("file b")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    (tmp_path / "file-link").symlink_to(tmp_path / "file-a")
    yield tmp_path
    mounts.unmount_below(tmp_path)


def spec_for(requested: list[api_pb2.Mount]) -> dict[str, Any]:
    return {
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            *(
                {"destination": m.container_path, "type": "bind", "source": m.host_path}
                for m in requested
            ),
        ]
    }


def swap_symlink(link: Path, target: Path) -> None:
    temp = link.with_name(link.name + ".new")
    temp.symlink_to(target)
    os.replace(temp, link)


def test_a_swap_after_the_pin_does_not_redirect_the_mount(host: Path) -> None:
    requested = [
        api_pb2.Mount(container_path="/data", host_path=str(host / "link")),
        api_pb2.Mount(container_path="/etc/conf", host_path=str(host / "file-link")),
    ]
    spec = spec_for(requested)
    pinned = pin_bind_sources(spec, requested, host / "bundle" / "mounts")
    # The attacker's move, between the check and runc's mount:
    swap_symlink(host / "link", host / "b")
    swap_symlink(host / "file-link", host / "file-b")
    os.rename(host / "a", host / "a-moved")
    sources = [Path(m["source"]) for m in spec["mounts"][1:]]
    assert all(host / "bundle" / "mounts" in s.parents for s in sources)
    # What runc will bind is what the path named when it was pinned.
    assert (sources[0] / "which").read_text() == "a"
    assert sources[1].read_text() == "file a"
    assert spec["mounts"][0]["source"] == "proc"  # only the request's bind mounts
    pinned.release()
    assert not (host / "bundle" / "mounts").exists()
    assert [p for p in mounts.mount_points() if host in p.parents] == []


def test_a_vanished_host_path_is_named(host: Path) -> None:
    requested = [
        api_pb2.Mount(container_path="/ok", host_path=str(host / "a")),
        api_pb2.Mount(container_path="/gone", host_path=str(host / "missing")),
    ]
    with pytest.raises(InvalidArgument, match=r"mounts\[1\]\.host_path"):
        pin_bind_sources(spec_for(requested), requested, host / "bundle" / "mounts")
    # The first pin was undone with the failure.
    assert [p for p in mounts.mount_points() if host in p.parents] == []


@pytest.fixture
def shared_host(tmp_path: Path) -> Iterator[Path]:
    """`tmp_path` as on a node where systemd made `/` shared: a shared mount, holding a
    mounted host path with a mount below it."""
    mounts.mount(str(tmp_path), tmp_path, None, mounts.MS_BIND)
    try:
        mounts.mount(None, tmp_path, None, mounts.MS_SHARED)
        source = tmp_path / "volume"
        source.mkdir()
        mounts.mount_tmpfs(source, size=1 << 20)
        (source / "below").mkdir()
        mounts.mount_tmpfs(source / "below", size=1 << 20)
        yield tmp_path
    finally:
        mounts.unmount_below(tmp_path)


@pytest.mark.parametrize(
    "propagation", [api_pb2.PROPAGATION_PRIVATE, api_pb2.PROPAGATION_HOST_TO_CONTAINER]
)
def test_releasing_a_shared_source_leaves_the_host_mounts(
    shared_host: Path, propagation: int
) -> None:
    requested = [
        api_pb2.Mount(
            container_path="/data", host_path=str(shared_host / "volume"), propagation=propagation
        )
    ]
    pinned = pin_bind_sources(spec_for(requested), requested, shared_host / "bundle" / "mounts")
    pinned.release()
    # Detaching the staging copy did not propagate back to the host path it copied.
    assert mounts.is_mounted(shared_host / "volume" / "below")
    assert mounts.is_mounted(shared_host / "volume")
