"""Hostile layers against the unpacker and the store: every trick is refused
with a message naming the entry, nothing outside the layer changes, and a refused layer
leaves nothing half-unpacked in the store. Legitimate oddities (setuid bits, whiteouts,
duplicate entries, FIFOs, overlay's own 0/0 whiteout devices) keep their meaning."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from cri_shim.config import parse_size
from cri_shim.errors import InvalidArgument
from cri_shim.images.layers import LayerBlob
from cri_shim.images.policy import UnpackPolicy
from cri_shim.images.store import ImageStore
from cri_shim.images.unpack import OPAQUE_XATTR, LayerError, unpack_layer
from cri_shim.state.db import Database
from tests.hostile_layers import HOSTILE_CASES, HostileCase, Tar, image_of_layers, store_leftovers

pytestmark = [pytest.mark.root]  # chown to other users, mknod, trusted.* xattrs


def policy_for(case: HostileCase) -> UnpackPolicy:
    settings = case.config or {}
    return UnpackPolicy(
        max_bytes=parse_size(settings.get("max_layer_bytes", "64GiB"), "max_layer_bytes"),
        max_entries=int(settings.get("max_layer_entries", 1_000_000)),  # type: ignore[call-overload]
    )


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the layer holding a victim file: escapes would land here."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "victim").write_bytes(b"original")
    return directory


def assert_untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"original"
    assert (outside / "victim").stat().st_nlink == 1  # not hard-linked from a layer


def unpack(data: bytes, dest: Path, policy: UnpackPolicy | None = None) -> Path:
    unpack_layer(io.BytesIO(data), dest, policy)
    return dest


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=[c.id for c in HOSTILE_CASES])
def test_hostile_layer_is_refused_naming_the_entry(
    tmp_path: Path, outside: Path, case: HostileCase
) -> None:
    with pytest.raises(LayerError) as info:
        unpack(case.build(outside), tmp_path / "layer" / "diff", policy_for(case))
    message = str(info.value)
    assert case.message in message
    assert case.entry in message
    assert_untouched(outside)


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=[c.id for c in HOSTILE_CASES])
def test_store_keeps_nothing_of_a_refused_layer(
    tmp_path: Path, outside: Path, db: Database, case: HostileCase
) -> None:
    # A good first layer, then the hostile one: the good one may stay (it is complete and
    # shared), the hostile one must leave no directory, row or image behind.
    good = Tar().dir("etc").file("etc/os-release", b"ok\n").bytes()
    image = image_of_layers([good, case.build(outside)])
    store = ImageStore(tmp_path / "root", db, unpack_policy=policy_for(case))
    for layer in image.layers:
        store.put_blob(layer.data, layer.digest)
    with pytest.raises(InvalidArgument) as info:
        store.add_image(image.config, [LayerBlob(x.digest, x.media_type) for x in image.layers])
    assert case.entry in str(info.value)
    assert store_leftovers(store.root, {p.name for p in store.layers_dir.iterdir()}) == []
    assert [p.name for p in store.tmp_dir.iterdir()] == []
    assert not any(p.name.startswith((".tmp", "tmp")) for p in store.layers_dir.iterdir())
    assert db.query("SELECT * FROM images") == []
    assert len(db.query("SELECT * FROM layers")) <= 1
    assert_untouched(outside)


def test_a_bomb_is_stopped_at_the_limit_not_decompressed_whole(tmp_path: Path) -> None:
    from tests.hostile_layers import zero_bomb

    dest = tmp_path / "layer"
    with pytest.raises(LayerError, match=r"1MiB.*images.max_layer_bytes"):
        unpack(zero_bomb(32 << 20), dest, UnpackPolicy(max_bytes=1 << 20))
    # The file was cut off at the limit, not written to its full 32MiB.
    written = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    assert written <= 1 << 20


def test_sparse_or_lying_sizes_count_against_the_limit(tmp_path: Path) -> None:
    # Two files of 600KiB each: the stream and the content both pass 1MiB at the second.
    data = Tar().file("a", bytes(600 << 10)).file("b", bytes(600 << 10)).bytes()
    with pytest.raises(LayerError, match=r"'b' takes the layer past 1MiB.*images\.max_layer_bytes"):
        unpack(data, tmp_path / "layer", UnpackPolicy(max_bytes=1 << 20))


def test_limits_allow_what_fits(tmp_path: Path) -> None:
    data = Tar().file("a", bytes(1000)).file("b", bytes(1000)).bytes()
    root = unpack(data, tmp_path / "layer", UnpackPolicy(max_bytes=len(data), max_entries=2))
    assert (root / "b").stat().st_size == 1000


def test_a_name_the_kernel_refuses_names_the_entry(tmp_path: Path) -> None:
    name = "d/" + "n" * 300
    with pytest.raises(LayerError, match=r"cannot be unpacked.*File name too long") as info:
        unpack(Tar().file(name).bytes(), tmp_path / "layer")
    assert name in str(info.value)


# --- device nodes, by policy --------------------------------------------------------------
def test_device_nodes_are_kept_only_when_allowed(tmp_path: Path) -> None:
    data = Tar().device("dev/null", tarfile.CHRTYPE, 1, 3).bytes()
    with pytest.raises(LayerError, match="'dev/null' is a character device"):
        unpack(data, tmp_path / "refused")
    root = unpack(data, tmp_path / "allowed", UnpackPolicy(allow_device_nodes=True))
    st = (root / "dev/null").lstat()
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3


def test_whiteout_devices_and_fifos_are_always_kept(tmp_path: Path) -> None:
    data = (
        Tar()
        .device("gone", tarfile.CHRTYPE, 0, 0)  # overlay's own whiteout form
        .add("pipe", tarfile.FIFOTYPE, mode=0o600)
        .bytes()
    )
    root = unpack(data, tmp_path / "layer")
    st = (root / "gone").lstat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert stat.S_ISFIFO((root / "pipe").lstat().st_mode)


# --- setuid bits exactly as the image says ---------------------------------------------
def test_setuid_and_setgid_bits_are_exactly_the_images(tmp_path: Path) -> None:
    data = (
        Tar()
        .file("suid", b"#!", mode=0o4755, uid=1000, gid=1000)
        .file("plain", b"#!", mode=0o755, uid=1000)
        .dir("shared", mode=0o2775, gid=50)
        .file("shared/implicit/f", b"x")  # shared/implicit is not in the archive
        .bytes()
    )
    root = unpack(data, tmp_path / "layer")
    suid = (root / "suid").stat()
    # chown clears setuid: it must have come before the chmod.
    assert stat.S_IMODE(suid.st_mode) == 0o4755 and suid.st_uid == 1000
    assert stat.S_IMODE((root / "plain").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "shared").stat().st_mode) == 0o2775
    # A directory the archive does not list gets 0755, not the setgid bit of its parent.
    assert stat.S_IMODE((root / "shared/implicit").stat().st_mode) == 0o755


# --- whiteouts and duplicates ----------------------------------------------------------------
def test_whiteouts_and_opaque_directories(tmp_path: Path) -> None:
    data = (
        Tar()
        .file("etc/kept")
        .file("etc/.wh.removed", b"")
        .file("etc/gone-later")
        .file("etc/.wh.gone-later", b"")  # a whiteout replaces an entry of this layer
        .dir("opaque")
        .file("opaque/.wh..wh..opq", b"")
        .file("opaque/new")
        .bytes()
    )
    root = unpack(data, tmp_path / "layer")
    for name in ("etc/removed", "etc/gone-later"):
        st = (root / name).lstat()
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, name
    assert os.getxattr(root / "opaque", OPAQUE_XATTR) == b"y"
    assert (root / "opaque/new").exists()
    assert not (root / "etc/.wh.removed").exists()


def test_duplicate_entries_last_one_wins_without_following_anything(
    tmp_path: Path, outside: Path
) -> None:
    data = (
        Tar()
        .file("f", b"first")
        .hardlink("linked", "f")
        .file("f", b"second")  # a new inode: the hard link keeps the first content
        .dir("d")
        .file("d/inner")
        .file("d", b"now a file")  # a directory replaced by a file
        .symlink("s", str(outside / "victim"))
        .file("s", b"replaces the link, never writes through it")
        .file("x", b"a file")
        .dir("x", mode=0o700)  # a file replaced by a directory
        .bytes()
    )
    root = unpack(data, tmp_path / "layer")
    assert (root / "f").read_bytes() == b"second"
    assert (root / "linked").read_bytes() == b"first"
    assert (root / "d").read_bytes() == b"now a file"
    assert not (root / "s").is_symlink()
    assert (root / "x").is_dir() and stat.S_IMODE((root / "x").stat().st_mode) == 0o700
    assert_untouched(outside)


def test_symlinks_pointing_outside_are_kept_as_data(tmp_path: Path, outside: Path) -> None:
    # Only a symlink's own entry: nothing follows it while unpacking, and inside the
    # container it resolves within the root filesystem.
    root = unpack(Tar().symlink("escape", "../../..").bytes(), tmp_path / "layer")
    assert os.readlink(root / "escape") == "../../.."
    assert_untouched(outside)


def test_the_uncompressed_stream_itself_is_limited(tmp_path: Path) -> None:
    # Small files but 2MiB of zeros after the end-of-archive blocks: still uncompressed
    # data to read and hash, so it counts.
    data = Tar().file("small", b"x").bytes() + bytes(2 << 20)
    with pytest.raises(LayerError, match=r"larger than 1MiB uncompressed.*'small'"):
        unpack(data, tmp_path / "layer", UnpackPolicy(max_bytes=1 << 20))


def test_sparse_maps_within_the_bound_are_unpacked(tmp_path: Path) -> None:
    from tests.hostile_layers import old_gnu_sparse, pax10_sparse

    for index, build in enumerate((old_gnu_sparse, pax10_sparse)):
        root = unpack(build(100), tmp_path / f"layer{index}")
        content = (root / "sparse").read_bytes()
        assert len(content) == 201 and content[1::2] == b"x" * 100 and not content[::2].strip(b"\0")


def test_a_layers_memory_does_not_grow_with_its_entry_count(tmp_path: Path) -> None:
    """tarfile keeps every member it reads, and directory times were listed: 0.5 GB at
    the default entry limit. Ten times the entries must not cost ten times the memory."""
    import tracemalloc

    def peak(count: int) -> int:
        tar = Tar()
        for index in range(count):
            tar.dir(f"d{index}")
        data = tar.bytes()
        tracemalloc.start()
        try:
            unpack(data, tmp_path / f"layer{count}")
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(1_000), peak(10_000)
    assert large < small + (1 << 20), (small, large)


def test_an_image_archive_gets_the_same_bounds_as_a_layer(
    store: ImageStore, tmp_path: Path
) -> None:
    """`cri-shim images import image.tar` reads the archive itself with tarfile too: its
    sparse maps are bounded, and so is the index of its entries."""
    from cri_shim.images.importer import import_image
    from tests.hostile_layers import many_entries, old_gnu_sparse

    sparse = tmp_path / "sparse.tar"
    sparse.write_bytes(old_gnu_sparse(2000))
    with pytest.raises(InvalidArgument, match="sparse map"):
        import_image(store, sparse)
    crowded = tmp_path / "crowded.tar"
    crowded.write_bytes(many_entries(100_001))
    with pytest.raises(InvalidArgument, match="more than 100000 entries"):
        import_image(store, crowded)
