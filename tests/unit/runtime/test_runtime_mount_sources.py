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
from cri_shim.runtime.mount_sources import PinnedSources, pin_bind_sources, release_staging
from tests.mountinfo import is_mounted, mount_points

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
    assert [p for p in mount_points() if host in p.parents] == []


def test_a_vanished_host_path_is_named(host: Path) -> None:
    requested = [
        api_pb2.Mount(container_path="/ok", host_path=str(host / "a")),
        api_pb2.Mount(container_path="/gone", host_path=str(host / "missing")),
    ]
    with pytest.raises(InvalidArgument, match=r"mounts\[1\]\.host_path"):
        pin_bind_sources(spec_for(requested), requested, host / "bundle" / "mounts")
    # The first pin was undone with the failure.
    assert [p for p in mount_points() if host in p.parents] == []


@pytest.fixture
def shared_node(tmp_path: Path) -> Iterator[Path]:
    """A shared mount (as `/` is on a systemd node) holding a pin directory like the
    daemon's: a shared mount of its own with a pin (a file bind mount) inside."""
    node = tmp_path / "node"
    pins = node / "run" / "netns"
    pins.mkdir(parents=True)
    (pins / "pod").touch()
    (tmp_path / "namespace").write_text("a pinned namespace")
    mounts.mount(str(node), node, None, mounts.MS_BIND)
    mounts.mount(None, node, None, mounts.MS_SHARED)
    mounts.mount(str(pins), pins, None, mounts.MS_BIND)
    mounts.mount(None, pins, None, mounts.MS_PRIVATE)
    mounts.mount(None, pins, None, mounts.MS_SHARED)
    mounts.mount(str(tmp_path / "namespace"), pins / "pod", None, mounts.MS_BIND)
    yield node
    mounts.unmount_below(tmp_path)


def staged(node: Path, host_path: Path, option: str) -> tuple[dict[str, Any], PinnedSources]:
    requested = [api_pb2.Mount(container_path="/host", host_path=str(host_path))]
    spec = {
        "mounts": [
            {
                "destination": "/host",
                "type": "bind",
                "source": str(host_path),
                "options": ["rbind", option],
            }
        ]
    }
    return spec, pin_bind_sources(spec, requested, node.parent / "bundle" / "mounts")


def node_mounts(node: Path) -> list[str]:
    return sorted(str(p) for p in mount_points() if p == node or node in p.parents)


@pytest.mark.parametrize("option", ["rprivate", "rslave", "rshared"])
@pytest.mark.parametrize("covers", ["node", "run", "pins"])
def test_releasing_a_staging_mount_leaves_the_mounts_it_covers(
    shared_node: Path, option: str, covers: str
) -> None:
    host_path = {
        "node": shared_node,
        "run": shared_node / "run",
        "pins": shared_node / "run" / "netns",
    }
    before = node_mounts(shared_node)
    spec, pinned = staged(shared_node, host_path[covers], option)
    point = Path(spec["mounts"][0]["source"])
    assert (point / "netns" / "pod" if covers == "run" else point).exists()
    pinned.release()
    assert node_mounts(shared_node) == before
    assert (shared_node / "run" / "netns" / "pod").read_text() == "a pinned namespace"


@pytest.mark.parametrize("option", ["rprivate", "rslave", "rshared"])
def test_staging_mounts_left_by_a_crash_are_released_without_touching_the_host(
    shared_node: Path, option: str
) -> None:
    before = node_mounts(shared_node)
    staged(shared_node, shared_node, option)  # the daemon dies here: nothing released
    bundle = shared_node.parent / "bundle"
    release_staging(bundle / "mounts")
    mounts.unmount_below(bundle)
    assert node_mounts(shared_node) == before
    assert [p for p in mount_points() if bundle in p.parents] == []


@pytest.mark.parametrize(
    ("option", "host_to_staging", "staging_to_host"),
    [("rprivate", False, False), ("rslave", True, False), ("rshared", True, True)],
)
def test_a_staging_mount_passes_on_what_its_propagation_promises(
    shared_node: Path, option: str, host_to_staging: bool, staging_to_host: bool
) -> None:
    for name in ("later", "back"):
        (shared_node / name).mkdir()
    spec, pinned = staged(shared_node, shared_node, option)
    point = Path(spec["mounts"][0]["source"])
    try:
        mounts.mount_tmpfs(shared_node / "later", size=1 << 20)
        mounts.mount_tmpfs(point / "back", size=1 << 20)
        assert is_mounted(point / "later") == host_to_staging
        assert is_mounted(shared_node / "back") == staging_to_host
    finally:
        pinned.release()
