"""Layer unpacking: content and metadata kept, whiteouts converted, escapes refused."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import os
import stat
import tarfile
from pathlib import Path

import pytest
import zstandard

from cri_shim.images.unpack import OPAQUE_XATTR, LayerError, UnpackPolicy, unpack_layer
from tests.hostile_layers import MTIME, Tar

pytestmark = [pytest.mark.root]  # chown to other users, mknod, trusted.* xattrs


def unpack(tmp_path: Path, data: bytes) -> tuple[Path, str]:
    dest = tmp_path / "layer" / "diff"
    result = unpack_layer(io.BytesIO(data), dest)
    return dest, result.diff_id


def test_files_dirs_links_keep_content_mode_owner_and_mtime(tmp_path: Path) -> None:
    data = (
        Tar()
        .dir("usr", mode=0o750, uid=12, gid=34)
        .dir("usr/bin")
        .file("usr/bin/tool", b"#!/bin/sh\n", mode=0o4755, uid=1000, gid=1000)
        .symlink("usr/bin/alias", "tool")
        .symlink("abs", "/etc/passwd")  # absolute targets are data, kept as written
        .hardlink("usr/bin/same", "usr/bin/tool")
        .add("pipe", tarfile.FIFOTYPE, mode=0o600)
        .add("null", tarfile.CHRTYPE, mode=0o666, devmajor=1, devminor=3)
        .bytes()
    )
    # Device nodes only by policy (refusal tested in test_image_unpack_hostile_layers.py).
    root = tmp_path / "layer" / "diff"
    unpack_layer(io.BytesIO(data), root, UnpackPolicy(allow_device_nodes=True))
    tool = root / "usr/bin/tool"
    st = tool.lstat()
    assert tool.read_bytes() == b"#!/bin/sh\n"
    # setuid survives because the mode is set after the owner (chown clears it).
    assert stat.S_IMODE(st.st_mode) == 0o4755
    assert (st.st_uid, st.st_gid) == (1000, 1000)
    assert st.st_mtime == MTIME
    usr = (root / "usr").lstat()
    assert stat.S_IMODE(usr.st_mode) == 0o750
    assert (usr.st_uid, usr.st_gid) == (12, 34)
    # Directory times are set after their children were created.
    assert usr.st_mtime == MTIME
    assert os.readlink(root / "usr/bin/alias") == "tool"
    assert os.readlink(root / "abs") == "/etc/passwd"
    assert (root / "usr/bin/same").lstat().st_ino == st.st_ino
    assert stat.S_ISFIFO((root / "pipe").lstat().st_mode)
    null = (root / "null").lstat()
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)


def test_diff_id_is_the_digest_of_the_whole_uncompressed_stream(tmp_path: Path) -> None:
    data = Tar().file("a", b"hello").bytes()
    # tarfile pads the archive to a record boundary; the diff ID covers the padding too.
    _, diff_id = unpack(tmp_path, data)
    assert diff_id == "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    "compress",
    [
        lambda d: d,
        lambda d: gzip.compress(d),
        lambda d: zstandard.ZstdCompressor().compress(d),
        lambda d: bz2.compress(d),
        lambda d: lzma.compress(d),
    ],
    ids=["plain", "gzip", "zstd", "bzip2", "xz"],
)
def test_compression_is_sniffed(tmp_path: Path, compress) -> None:  # type: ignore[no-untyped-def]
    data = Tar().dir("etc").file("etc/hello", b"world").bytes()
    root, diff_id = unpack(tmp_path, compress(data))
    assert (root / "etc/hello").read_bytes() == b"world"
    assert diff_id == "sha256:" + hashlib.sha256(data).hexdigest()


def test_whiteout_becomes_an_overlay_whiteout_device(tmp_path: Path) -> None:
    data = Tar().dir("etc").file("etc/.wh.passwd", b"").file(".wh.toplevel", b"").bytes()
    root, _ = unpack(tmp_path, data)
    for path in (root / "etc/passwd", root / "toplevel"):
        st = path.lstat()
        assert stat.S_ISCHR(st.st_mode)
        assert st.st_rdev == os.makedev(0, 0)
    assert not (root / "etc/.wh.passwd").exists()
    assert not (root / ".wh.toplevel").exists()


def test_opaque_whiteout_marks_the_directory_and_keeps_its_new_entries(tmp_path: Path) -> None:
    # The marker may come after entries of the same directory: they must stay.
    data = (
        Tar()
        .dir("opt")
        .file("opt/new", b"n")
        .file("opt/.wh..wh..opq", b"")
        .file("var/lib/.wh..wh..opq", b"")  # parents created implicitly
        .bytes()
    )
    root, _ = unpack(tmp_path, data)
    assert os.getxattr(root / "opt", OPAQUE_XATTR) == b"y"
    assert os.getxattr(root / "var/lib", OPAQUE_XATTR) == b"y"
    assert (root / "opt/new").read_bytes() == b"n"
    assert not (root / "opt/.wh..wh..opq").exists()


def test_aufs_metadata_entries_are_skipped(tmp_path: Path) -> None:
    # aufs kept hardlink sources in .wh..wh.plnk; docker drops them, and so do we.
    tar = Tar().dir(".wh..wh.plnk").file(".wh..wh.plnk/123.456", b"").file(".wh..wh.aufs")
    root, _ = unpack(tmp_path, tar.file("ok").bytes())
    assert sorted(p.name for p in root.iterdir()) == ["ok"]


def test_later_entries_replace_earlier_ones(tmp_path: Path) -> None:
    data = Tar().file("a", b"first").file("a", b"second").file("d/x").dir("d").bytes()
    root, _ = unpack(tmp_path, data)
    assert (root / "a").read_bytes() == b"second"
    assert (root / "d/x").exists()  # a dir entry for an existing dir keeps its children
    data = Tar().dir("d").file("d/x").file("d", b"now a file").bytes()
    root2, _ = unpack(tmp_path / "again", data)
    assert (root2 / "d").read_bytes() == b"now a file"


def test_xattrs_are_applied_but_overlay_ones_refused(tmp_path: Path) -> None:
    tar = Tar()
    info = tarfile.TarInfo("f")
    info.pax_headers = {"SCHILY.xattr.user.origin": "test"}
    tar.tar.addfile(info, io.BytesIO(b""))
    root, _ = unpack(tmp_path, tar.bytes())
    assert os.getxattr(root / "f", "user.origin") == b"test"

    bad = Tar()
    info = tarfile.TarInfo("d")
    info.type = tarfile.DIRTYPE
    info.pax_headers = {"SCHILY.xattr.trusted.overlay.redirect": "/elsewhere"}
    bad.tar.addfile(info)
    with pytest.raises(LayerError, match="reserved xattr"):
        unpack(tmp_path / "bad", bad.bytes())


def test_root_entry_sets_the_layer_root_metadata(tmp_path: Path) -> None:
    root, _ = unpack(tmp_path, Tar().dir("./", mode=0o700).file("./a").bytes())
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert (root / "a").exists()


# --- escapes -----------------------------------------------------------------------------
def _nothing_outside(tmp_path: Path) -> None:
    outside = {p.name for p in tmp_path.iterdir()}
    assert outside <= {"layer", "victim"}, outside
    if (tmp_path / "victim").exists():
        assert (tmp_path / "victim").read_bytes() == b"original"


@pytest.mark.parametrize(
    ("tar", "message"),
    [
        (Tar().file("../escaped"), "'..'"),
        (Tar().file("a/../../escaped"), "'..'"),
        (Tar().file("/abs/escaped"), "absolute"),
        (Tar().file("a/.wh..."), "'..'"),  # a whiteout of ".."
        (Tar().hardlink("h", "../victim"), "'..'"),
        (Tar().hardlink("h", "/etc/passwd"), "absolute"),
        (Tar().hardlink("h", "missing"), "not in this layer"),
        (Tar().dir("d").hardlink("h", "d"), "directory"),
    ],
    ids=[
        "dotdot",
        "nested-dotdot",
        "absolute",
        "whiteout-dotdot",
        "hardlink-dotdot",
        "hardlink-absolute",
        "hardlink-missing",
        "hardlink-dir",
    ],
)
def test_paths_leaving_the_layer_are_refused(tmp_path: Path, tar: Tar, message: str) -> None:
    (tmp_path / "victim").write_bytes(b"original")
    with pytest.raises(LayerError, match=message):
        unpack(tmp_path, tar.bytes())
    _nothing_outside(tmp_path)


@pytest.mark.parametrize("target", ["..", "../..", str(Path("/tmp")), "inner"])
def test_writing_through_a_symlink_is_refused(tmp_path: Path, target: str) -> None:
    # `link` points outside (or even inside: still refused, nothing may follow a link).
    tar = Tar().dir("inner").symlink("link", target).file("link/escaped", b"pwned")
    with pytest.raises(LayerError, match="symlink"):
        unpack(tmp_path, tar.bytes())
    _nothing_outside(tmp_path)
    assert not Path("/tmp/escaped").exists()
    assert not (tmp_path / "layer/diff/inner/escaped").exists()


def test_whiteout_through_a_symlink_is_refused(tmp_path: Path) -> None:
    tar = Tar().symlink("link", str(tmp_path)).file("link/.wh.victim", b"")
    (tmp_path / "victim").write_bytes(b"original")
    with pytest.raises(LayerError, match="symlink"):
        unpack(tmp_path, tar.bytes())
    _nothing_outside(tmp_path)


def test_hardlink_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "victim").write_bytes(b"original")
    tar = Tar().symlink("link", str(tmp_path)).hardlink("h", "link/victim")
    with pytest.raises(LayerError, match="symlink"):
        unpack(tmp_path, tar.bytes())
    _nothing_outside(tmp_path)


def test_symlink_replaced_by_file_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "victim").write_bytes(b"original")
    tar = Tar().symlink("f", str(tmp_path / "victim")).file("f", b"new")
    root, _ = unpack(tmp_path, tar.bytes())
    assert (root / "f").read_bytes() == b"new" and not (root / "f").is_symlink()
    _nothing_outside(tmp_path)


def test_garbage_is_not_a_layer(tmp_path: Path) -> None:
    with pytest.raises(LayerError, match="not a valid"):
        unpack(tmp_path, gzip.compress(b"this is not a tar archive, just text " * 20))
    with pytest.raises(LayerError, match="not a valid"):
        unpack(tmp_path / "2", b"\x1f\x8b\x08\x00garbage")
