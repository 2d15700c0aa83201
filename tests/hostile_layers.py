"""Hostile image layers, built by the tests: every trick a layer tarball can play
on an unpacker, each aimed at a marker path outside the layer, and the way to wrap one
into an image for `cri-shim images import` or a registry push.

Each `HostileCase` writes (or tries to) to `<outside>/escaped-<case>`, where `outside` is a
directory of the test's own; the test then checks that nothing appeared there and that the
refusal named the entry. Cases are built lazily because some need that directory's path.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.imagebuild import (
    BuiltImage,
    BuiltLayer,
    _goarch,
    digest_of,
    layout_files,
)

MTIME = 1_600_000_000


class Tar:
    """A layer tar written entry by entry, including entries no sane tool would write."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.PAX_FORMAT)

    def add(self, name: str, kind: bytes, data: bytes = b"", **attrs: Any) -> Tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = int(attrs.pop("mode", 0o644))
        info.mtime = MTIME
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        for key, value in attrs.items():
            setattr(info, key, value)
        self.tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        return self

    def dir(self, name: str, **attrs: Any) -> Tar:
        attrs.setdefault("mode", 0o755)
        return self.add(name, tarfile.DIRTYPE, **attrs)

    def file(self, name: str, data: bytes = b"x", **attrs: Any) -> Tar:
        return self.add(name, tarfile.REGTYPE, data, **attrs)

    def symlink(self, name: str, target: str) -> Tar:
        return self.add(name, tarfile.SYMTYPE, linkname=target, mode=0o777)

    def hardlink(self, name: str, target: str) -> Tar:
        return self.add(name, tarfile.LNKTYPE, linkname=target)

    def device(self, name: str, kind: bytes, major: int, minor: int) -> Tar:
        return self.add(name, kind, devmajor=major, devminor=minor, mode=0o666)

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buffer.getvalue()


def zero_bomb(size: int, name: str = "bomb", pattern: bytes = b"\0") -> bytes:
    """A gzip layer of one file of `size` zero bytes (or `pattern` repeated): a few KiB
    on the wire per MiB unpacked. Written in pieces, so that building it never holds
    `size` bytes."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=9) as gz:
        header = tarfile.TarInfo(name)
        header.size, header.mode, header.mtime = size, 0o644, MTIME
        gz.write(header.tobuf(tarfile.PAX_FORMAT))
        chunk = (pattern * ((1 << 20) // len(pattern) + 1))[: 1 << 20]
        remaining = size
        while remaining:
            gz.write(chunk[: min(remaining, len(chunk))])
            remaining -= min(remaining, len(chunk))
        gz.write(bytes(-size % 512) + bytes(1024))
    return out.getvalue()


def many_entries(count: int) -> bytes:
    tar = Tar()
    for index in range(count):
        tar.file(f"f{index}", b"")
    return tar.bytes()


def huge_pax_header() -> bytes:
    """A PAX header of 2MiB: tarfile would read it whole into memory."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("padded")
        info.pax_headers = {"comment": "x" * (2 << 20)}
        tar.addfile(info, io.BytesIO(b""))
    return out.getvalue()


def _header(info: tarfile.TarInfo, patch: dict[int, bytes]) -> bytes:
    """A GNU header block for `info` with bytes patched in at offsets, checksum redone."""
    block = bytearray(info.tobuf(tarfile.GNU_FORMAT)[-512:])
    for offset, value in patch.items():
        block[offset : offset + len(value)] = value
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(block))[0]
    return bytes(block)


def _octal(value: int, width: int = 12) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def old_gnu_sparse(regions: int, name: str = "sparse") -> bytes:
    """A GNU sparse entry (type S) whose map has `regions` one-byte regions: 4 in the
    header, 21 in each extension block after it. tarfile builds a tuple for each before
    anything can look at the entry."""
    structs = [(2 * i + 1, 1) for i in range(regions)]
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.mtime = tarfile.GNUTYPE_SPARSE, regions, 0o644, MTIME
    patch = {482: b"\1" if regions > 4 else b"\0", 483: _octal(2 * regions + 1)}
    for index, (offset, size) in enumerate(structs[:4]):
        patch[386 + 24 * index] = _octal(offset) + _octal(size)
    out = [_header(info, patch)]
    rest = structs[4:]
    while rest:
        chunk, rest = rest[:21], rest[21:]
        block = bytearray(512)
        for index, (offset, size) in enumerate(chunk):
            block[24 * index : 24 * index + 24] = _octal(offset) + _octal(size)
        block[504] = 1 if rest else 0
        out.append(bytes(block))
    data = b"x" * regions
    out.append(data + bytes(-len(data) % 512) + bytes(1024))
    return b"".join(out)


def sparse_map_bomb(blocks: int) -> bytes:
    """A gzip layer of one old GNU sparse entry followed by `blocks` identical extension
    blocks of 21 regions each: about 1 KB on the wire per thousand blocks, and a tuple per
    region for tarfile (0.4 MB of layer took the daemon to 1.2 GB)."""
    info = tarfile.TarInfo("sparse-bomb")
    info.type, info.size, info.mode, info.mtime = tarfile.GNUTYPE_SPARSE, 0, 0o644, MTIME
    region = _octal(1) + _octal(1)
    header = _header(info, {386: region * 4, 482: b"\1", 483: _octal(2)})
    block = bytearray(region * 21 + bytes(512 - 21 * 24))
    block[504] = 1
    last = bytes(block[:504]) + bytes(8)
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(header)
        batch = bytes(block) * 1024
        for _ in range(blocks // 1024):
            gz.write(batch)
        gz.write(bytes(block) * (blocks % 1024) + last + bytes(1024))
    return out.getvalue()


def pax10_sparse(regions: int, name: str = "sparse") -> bytes:
    """A PAX (GNU 1.0) sparse entry: the map is read from the entry's data, number by
    number, as many as its first line says."""
    mapping = f"{regions}\n".encode() + b"".join(
        f"{2 * i + 1}\n1\n".encode() for i in range(regions)
    )
    mapping += bytes(-len(mapping) % 512)
    info = tarfile.TarInfo("GNUSparseFile.0/" + name)
    data = mapping + b"x" * regions
    info.size, info.mode, info.mtime = len(data), 0o644, MTIME
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": name,
        "GNU.sparse.realsize": str(2 * regions + 1),
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def pax_record(name: str, kind: bytes = tarfile.REGTYPE, **records: str) -> bytes:
    """One entry whose PAX header carries `records` as written (`uid="1099511627776"`,
    `mtime="nan"`): values tarfile would refuse to write itself."""
    body = b"".join(_pax_line(k, v) for k, v in records.items())
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, len(body)
    info = tarfile.TarInfo(name)
    data = b"x" if kind == tarfile.REGTYPE else b""
    info.type, info.size, info.mode, info.mtime = kind, len(data), 0o644, MTIME
    return b"".join(
        (
            header.tobuf(tarfile.USTAR_FORMAT),
            body + bytes(-len(body) % 512),
            info.tobuf(tarfile.USTAR_FORMAT),
            data + bytes(-len(data) % 512),
            bytes(1024),
        )
    )


def _pax_line(key: str, value: str) -> bytes:
    record = f" {key}={value}\n".encode("utf-8", "surrogateescape")
    length = len(record) + 1
    while len(str(length)) + len(record) != length:
        length = len(str(length)) + len(record)
    return str(length).encode() + record


@dataclass(frozen=True)
class HostileCase:
    """One hostile layer: what it is, how to build it, what the refusal must say."""

    id: str
    build: Callable[[Path], bytes]  # outside dir → the layer tar (maybe compressed)
    message: str  # a fragment the refusal must contain
    entry: str  # the entry the refusal must name ("" when it is not about one entry)
    config: dict[str, object] | None = None  # [images] settings the case needs


def _through_symlink_chain(outside: Path) -> bytes:
    # l1 → l2 → the outside directory; the file is then written "through" the chain.
    return (
        Tar()
        .symlink("l2", str(outside))
        .symlink("l1", "l2")
        .file("l1/escaped-chain", b"pwned")
        .bytes()
    )


def _through_relative_symlink(outside: Path) -> bytes:
    # ../../../.. from the layer directory reaches / on any store layout; the rest of the
    # way down to the outside directory is then an ordinary relative path.
    up = "../" * 32
    return (
        Tar().symlink("up", up.rstrip("/")).file(f"up{outside}/escaped-relative", b"pwned").bytes()
    )


def _hardlink_to_symlink(outside: Path) -> bytes:
    # The hard link copies the symlink itself; writing through it is still refused.
    return (
        Tar()
        .symlink("s", str(outside))
        .hardlink("h", "s")
        .file("h/escaped-hardlinked-symlink", b"pwned")
        .bytes()
    )


def _hardlink_outside(outside: Path) -> bytes:
    return Tar().hardlink("h", str(outside / "victim")).bytes()


def _hardlink_dotdot(outside: Path) -> bytes:
    return Tar().hardlink("h", "../../../../../../../../victim").bytes()


def _hardlink_through_symlink(outside: Path) -> bytes:
    return Tar().symlink("link", str(outside)).hardlink("h", "link/victim").bytes()


def _whiteout_through_symlink(outside: Path) -> bytes:
    return Tar().symlink("link", str(outside)).file("link/.wh.victim", b"").bytes()


HOSTILE_CASES: list[HostileCase] = [
    HostileCase(
        "dotdot",
        lambda o: Tar().file("a/../../../../../../../../../../escaped-dotdot").bytes(),
        "'..'",
        "a/../../../../../../../../../../escaped-dotdot",
    ),
    HostileCase(
        "absolute",
        lambda o: Tar().file(str(o / "escaped-absolute")).bytes(),
        "absolute path",
        "escaped-absolute",
    ),
    HostileCase("symlink-chain", _through_symlink_chain, "symlink", "l1/escaped-chain"),
    HostileCase("symlink-relative", _through_relative_symlink, "symlink", "escaped-relative"),
    HostileCase(
        "hardlinked-symlink",
        _hardlink_to_symlink,
        "symlink",
        "h/escaped-hardlinked-symlink",
    ),
    HostileCase("hardlink-absolute", _hardlink_outside, "absolute path", "hardlink 'h'"),
    HostileCase("hardlink-dotdot", _hardlink_dotdot, "'..'", "hardlink 'h'"),
    HostileCase("hardlink-through-symlink", _hardlink_through_symlink, "symlink", "hardlink 'h'"),
    HostileCase(
        "whiteout-through-symlink", _whiteout_through_symlink, "symlink", "link/.wh.victim"
    ),
    HostileCase(
        "char-device",
        lambda o: Tar().device("dev/mem", tarfile.CHRTYPE, 1, 1).bytes(),
        "images.allow_device_nodes",
        "dev/mem",
    ),
    HostileCase(
        "block-device",
        lambda o: Tar().device("dev/sda", tarfile.BLKTYPE, 8, 0).bytes(),
        "images.allow_device_nodes",
        "dev/sda",
    ),
    HostileCase(
        "empty-whiteout",
        lambda o: Tar().dir("d").file("d/.wh.", b"").bytes(),
        "whiteout",
        "d/.wh.",
    ),
    HostileCase(
        "decompression-bomb",
        lambda o: zero_bomb(8 << 20),
        "images.max_layer_bytes",
        "bomb",
        {"max_layer_bytes": "1MiB"},
    ),
    HostileCase(
        "entry-count",
        lambda o: many_entries(50),
        "images.max_layer_entries",
        "f10",
        {"max_layer_entries": 10},
    ),
    HostileCase("pax-header", lambda o: huge_pax_header(), "metadata header", ""),
    HostileCase("sparse-map", lambda o: old_gnu_sparse(2000), "sparse map", "sparse"),
    HostileCase("sparse-map-pax", lambda o: pax10_sparse(2000), "sparse map", "sparse"),
    HostileCase(
        "sparse-map-pax01",
        lambda o: pax_record(
            "sparse01", **{"GNU.sparse.map": ",".join(["1,1"] * 2000), "GNU.sparse.size": "2"}
        ),
        "sparse map",
        "sparse01",
    ),
    HostileCase(
        "pax-uid",
        lambda o: pax_record("big-uid", uid=str(2**40)),
        "owner 1099511627776",
        "big-uid",
    ),
    HostileCase(
        "pax-negative-gid",
        lambda o: pax_record("negative-gid", gid="-1"),
        "group -1",
        "negative-gid",
    ),
    HostileCase("pax-mtime", lambda o: pax_record("nan-mtime", mtime="nan"), "mtime", "nan-mtime"),
    HostileCase(
        "pax-nul-in-link",
        lambda o: pax_record("nul-link", tarfile.SYMTYPE, linkpath="a\x00b"),
        "NUL",
        "nul-link",
    ),
    HostileCase(
        "pax-nul-in-xattr",
        lambda o: pax_record("nul-xattr", **{"SCHILY.xattr.user.a\x00b": "v"}),
        "NUL",
        "nul-xattr",
    ),
    HostileCase(
        "too-deep",
        lambda o: Tar().file("d/" * 300 + "f").bytes(),
        "deep",
        "d/d/d/d",
    ),
]


def image_of_layers(tars: list[bytes]) -> BuiltImage:
    """An OCI image whose layers are exactly `tars` (gzip-compressed unless already)."""
    layers = []
    for tar in tars:
        compressed = tar[:2] == b"\x1f\x8b"
        data = tar if compressed else gzip.compress(tar, mtime=0)
        plain = gzip.decompress(data)
        layers.append(
            BuiltLayer(
                data=data,
                digest=digest_of(data),
                diff_id=digest_of(plain),
                media_type="application/vnd.oci.image.layer.v1.tar+gzip",
                tar=plain,
            )
        )
    config = {
        "architecture": _goarch(),
        "os": "linux",
        "config": {"Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest_of(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    return BuiltImage(
        config=config_bytes,
        config_digest=digest_of(config_bytes),
        manifest=manifest_bytes,
        manifest_digest=digest_of(manifest_bytes),
        manifest_media_type="application/vnd.oci.image.manifest.v1+json",
        layers=layers,
    )


def write_layout(image: BuiltImage, dest: Path, ref_name: str) -> Path:
    for name, data in layout_files(image, ref_name).items():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return dest


def store_leftovers(root: Path, committed: set[str] | None = None) -> list[str]:
    """What a refused layer could leave in the image store under `root`: temporary or
    trash directories, and layer directories other than `committed` (chain hex names)."""
    found = []
    layers = root / "images" / "layers"
    tmp = root / "images" / "tmp"
    if layers.exists():
        found += [p.name for p in layers.iterdir() if p.name not in (committed or set())]
    if tmp.exists():
        found += [f"tmp/{p.name}" for p in tmp.iterdir()]
    return found
