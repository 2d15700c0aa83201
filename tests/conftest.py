"""Shared fixtures: a test network and the real daemon, both cleaned up whatever happens."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.images.store import ImageStore
from cri_shim.state.db import Database
from tests.harness import CniTestNetwork, Daemon, make_test_network
from tests.imagebuild import cached_oci_layout

_counter = itertools.count()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (namespaces, mounts, runc, CNI)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short path: unix socket paths are limited to 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    # Searchable by anyone, as /var/lib is: a container in a user namespace of its own
    # must reach its root filesystem as an unprivileged host id.
    path.chmod(0o711)
    yield path
    _force_unmount_below(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def test_network(short_tmp: Path) -> Iterator[CniTestNetwork]:
    network = make_test_network(short_tmp, next(_counter))
    yield network
    network.remove()


@pytest.fixture
def daemon(short_tmp: Path, test_network: CniTestNetwork) -> Iterator[Daemon]:
    """A started daemon; tests may change `settings` and call restart()."""
    d = Daemon(short_tmp, test_network)
    d.start()
    yield d
    d.stop()


@pytest.fixture
def make_daemon(short_tmp: Path, test_network: CniTestNetwork) -> Iterator[type]:
    """Build a daemon with settings before it starts: make_daemon(settings={...})."""
    made: list[Daemon] = []

    def factory(**kwargs: object) -> Daemon:
        d = Daemon(short_tmp, test_network, **kwargs)  # type: ignore[arg-type]
        made.append(d)
        return d

    yield factory  # type: ignore[misc]
    for d in made:
        d.stop()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(tmp_path / "state" / "state.db")
    yield database
    database.close()


@pytest.fixture
def store(tmp_path: Path, db: Database) -> ImageStore:
    return ImageStore(tmp_path / "root", db)


@pytest.fixture(scope="session")
def busybox_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default busybox test image as an OCI layout (shared: do not modify)."""
    return cached_oci_layout(tmp_path_factory.getbasetemp() / "images")


def _force_unmount_below(path: Path) -> None:
    """Last resort after a failed test, so one failure does not poison the next tests."""
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(str(path))
    ]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
