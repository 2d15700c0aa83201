"""inotify on its own: which files appeared in a watched directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cri_shim.host.inotify import DirectoryWatch


def test_directory_watch_sees_a_file_renamed_into_place(tmp_path: Path) -> None:
    """conmon (glib's g_file_set_contents) writes a temporary file and renames it."""
    with DirectoryWatch([tmp_path]) as watch:
        assert watch.read() == []
        temporary = tmp_path / "abc.X1Y2Z3"
        temporary.write_text("0")
        os.rename(temporary, tmp_path / "abc")
        names = [event.name for event in watch.read()]
    assert names == ["abc.X1Y2Z3", "abc"]


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"inotify_add_watch .*missing"):
        DirectoryWatch([tmp_path / "missing"])
