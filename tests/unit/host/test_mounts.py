"""What the mount helpers read from mountinfo, and unmounting a tree (root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cri_shim.host.mounts import (
    mount_tmpfs,
    mounted,
    propagation,
    unescape_mountinfo,
    unmount_below,
)
from tests.mountinfo import is_mounted, mount_points


def test_mountinfo_escapes_are_decoded() -> None:
    assert unescape_mountinfo(r"/run/my\040dir/a\134b") == "/run/my dir/a\\b"
    assert unescape_mountinfo("/plain/path") == "/plain/path"
    assert unescape_mountinfo("/trailing\\04") == "/trailing\\04"
    assert unescape_mountinfo("/ends/in\\040") == "/ends/in "


def test_the_root_is_a_mount_point_and_a_fresh_directory_is_not(tmp_path: Path) -> None:
    assert Path("/") in mount_points()
    assert is_mounted(Path("/"))
    assert not is_mounted(tmp_path)
    assert propagation(tmp_path) is None
    assert propagation(Path("/")) is not None


def test_mounted_answers_for_many_paths_at_once(tmp_path: Path) -> None:
    (tmp_path / "root").symlink_to("/")
    asked = [Path("/"), tmp_path, tmp_path / "root", tmp_path / "missing"]
    assert mounted(asked) == {Path("/"), tmp_path / "root"}


@pytest.mark.root
def test_unmount_below_takes_every_mount_under_a_directory_and_nothing_beside_it(
    tmp_path: Path,
) -> None:
    root, sibling = tmp_path / "pod", tmp_path / "pod-other"
    nested, spaced = root / "a" / "b", root / "with space"
    for path in (root, nested, spaced, sibling):
        path.mkdir(parents=True, exist_ok=True)
    mount_tmpfs(root, size=1 << 20)
    for path in (nested, nested, spaced, sibling):  # `nested` twice: stacked mounts
        path.mkdir(parents=True, exist_ok=True)
        mount_tmpfs(path, size=1 << 20)
    try:
        assert mounted([root, nested, spaced, sibling]) == {root, nested, spaced, sibling}
        unmount_below(root)
        assert mounted([root, nested, spaced, sibling]) == {sibling}
        unmount_below(root)  # nothing left there: nothing to do
    finally:
        unmount_below(tmp_path)
    assert not mounted([sibling])


def test_a_tree_written_into_while_it_is_removed_is_removed_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from cri_shim.host import mounts

    root = tmp_path / "bundle"
    (root / "rootfs").mkdir(parents=True)
    (root / "config.json").write_text("{}")
    real_rmtree = mounts.shutil.rmtree
    removals = []

    def rmtree_then_a_late_writer(path: Path, **kwargs: object) -> None:
        real_rmtree(path, **kwargs)
        removals.append(path)
        if len(removals) == 1:  # a monitor writes its file just after the first removal
            root.mkdir()
            (root / "pidfile").write_text("1")

    monkeypatch.setattr(mounts.shutil, "rmtree", rmtree_then_a_late_writer)
    monkeypatch.setattr(mounts, "REMOVE_RETRY_DELAY", 0)
    assert mounts.remove_tree(root)
    assert not root.exists() and len(removals) == 2
    assert not caplog.records


def test_a_tree_that_cannot_be_removed_is_logged_with_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from cri_shim.host import mounts

    root = tmp_path / "bundle"
    (root / "upper").mkdir(parents=True)

    def refused(path: Path, onerror: object) -> None:
        onerror(mounts.os.rmdir, str(root / "upper"), (OSError, OSError(16, "busy"), None))  # type: ignore[operator]

    monkeypatch.setattr(mounts.shutil, "rmtree", refused)
    monkeypatch.setattr(mounts, "REMOVE_RETRY_DELAY", 0)
    assert not mounts.remove_tree(root)
    assert root.exists()
    assert f"{root} could not be removed: {root / 'upper'}: [Errno 16] busy" in caplog.text


def test_a_tree_already_gone_is_removed(tmp_path: Path) -> None:
    from cri_shim.host import mounts

    assert mounts.remove_tree(tmp_path / "never-made")
