"""Unpacking one layer tarball into one directory, in overlayfs' on-disk form.

The compression is sniffed from the magic bytes (gzip, zstd, bzip2, xz, or none), not taken
from the media type, because archives in the wild lie about it. The uncompressed stream is
hashed while it is extracted, so the caller can check the layer's diff ID in the same pass.

OCI whiteouts become overlay whiteouts: `.wh.<name>` a 0/0 character device named `<name>`,
`.wh..wh..opq` the `trusted.overlay.opaque=y` xattr on its directory.

Every path is resolved one component at a time from a directory fd with O_NOFOLLOW, so an
entry can never be written outside the layer directory or through a symlink, whatever the
archive contains; entries that try are refused with `InvalidArgument`.

Hostile archives meet an `UnpackPolicy`: limits on the uncompressed bytes and on
the number of entries (a decompression bomb stops at the limit, and the message names the
config key), bounded tar metadata (PAX and GNU long-name headers, path length and depth),
and character or block devices refused unless the configuration allows them (0/0
character devices, overlay's own whiteouts, are always kept). Every refusal names the
entry. Setuid, setgid and sticky bits are exactly the image's: directories this extractor
creates on its own get a plain 0755, not bits inherited from a setgid parent.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import lzma
import math
import os
import shutil
import stat
import struct
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import zstandard

from cri_shim.config import format_size
from cri_shim.errors import InvalidArgument
from cri_shim.images.policy import UnpackPolicy

WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
AUFS_META_PREFIX = ".wh..wh."
OPAQUE_XATTR = "trusted.overlay.opaque"
# Xattrs an archive must not set: overlayfs trusts them to decide what a merged directory
# shows (redirects, metacopy, opaque), so a forged one could expose another layer's files.
_FORBIDDEN_XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")
_PAX_XATTR = "SCHILY.xattr."
_CHUNK = 1 << 20
_DIR_TIME = struct.Struct("<dH")  # a directory's mtime and its path's length, spooled
_NODE_TYPES = {
    tarfile.CHRTYPE: stat.S_IFCHR,
    tarfile.BLKTYPE: stat.S_IFBLK,
    tarfile.FIFOTYPE: stat.S_IFIFO,
}

# Tar metadata that tarfile reads into memory: one PAX or GNU long-name header, all of them
# in one archive, and how many may precede one entry (tarfile recurses once per header).
# Go's archive/tar allows 1MiB per header too; real layers need a few hundred bytes.
_MAX_SPECIAL_HEADER = 1 << 20
_MAX_SPECIAL_TOTAL = 64 << 20
_MAX_HEADER_CHAIN = 8
# PATH_MAX, and a depth no real image needs: a deeper tree would also overflow the
# recursion of the rmtree that cleans up a refused layer.
_MAX_NAME_BYTES = 4096
_MAX_DEPTH = 256
# Regions in one sparse entry's map: tarfile makes a tuple of each (and the 1.0 format reads
# the map from the entry's data, as long as it goes) before anything sees the entry. GNU tar
# writes one per run of data; images have next to no sparse files.
MAX_SPARSE_REGIONS = 1024
# Owners are 32-bit; (uid_t)-1 means "leave unchanged" to chown, so it is refused too.
_MAX_ID = (1 << 32) - 2
# Times os.utime can set (a time_t of seconds); NaN and infinities are not times.
_MAX_TIME = float(1 << 62)
# Errors that say the host is unwell (disk full, read-only, not root), not the archive.
_HOST_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EIO,
        errno.ENOMEM,
        errno.EMFILE,
        errno.ENFILE,
        errno.EACCES,
        errno.EPERM,
    }
)

_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
)


@dataclass(frozen=True)
class UnpackResult:
    diff_id: str  # sha256 of the uncompressed tar stream
    size: int  # bytes of file content written (hardlinks counted once)


class LayerError(InvalidArgument):
    """The layer archive is malformed or tries to write where it must not."""


class _TooLarge(LayerError):
    """The uncompressed stream passed `max_bytes`; re-raised naming the entry."""


_SPECIAL_TYPES = frozenset(
    {
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
    }
)


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a PAX or GNU long-name header whole into memory, and recurses once
    per header before an entry: both are bounded here, before the read."""

    def _proc_member(self, archive: tarfile.TarFile) -> Any:
        if self.type not in _SPECIAL_TYPES:
            return super()._proc_member(archive)  # type: ignore[misc]
        chain = getattr(archive, "_cri_shim_chain", 0)
        total = getattr(archive, "_cri_shim_special", 0) + self.size
        if self.size > _MAX_SPECIAL_HEADER or total > _MAX_SPECIAL_TOTAL:
            raise LayerError(
                f"layer has a tar metadata header (PAX or long name) of {self.size} bytes "
                f"at offset {self.offset}; at most {_MAX_SPECIAL_HEADER} are accepted"
            )
        if chain >= _MAX_HEADER_CHAIN:
            raise LayerError(
                f"layer has more than {_MAX_HEADER_CHAIN} tar metadata headers in a row "
                f"at offset {self.offset}"
            )
        archive._cri_shim_chain = chain + 1  # type: ignore[attr-defined]
        archive._cri_shim_special = total  # type: ignore[attr-defined]
        try:
            return super()._proc_member(archive)  # type: ignore[misc]
        finally:
            archive._cri_shim_chain = chain  # type: ignore[attr-defined]

    # Sparse maps, in each of the four forms tarfile reads, are counted before they are
    # turned into objects.
    def _sparse_refused(self, regions: int | str) -> LayerError:
        return LayerError(
            f"entry {self.name!r} has a sparse map of {regions} regions at offset "
            f"{self.offset}; at most {MAX_SPARSE_REGIONS} are accepted"
        )

    def _proc_sparse(self, archive: tarfile.TarFile) -> Any:
        """Old GNU sparse (type S): 4 regions in the header, 21 in each extension block
        that follows it (tarfile's own reader, with the bound)."""
        structs, isextended, size = self._sparse_structs  # type: ignore[attr-defined]
        del self._sparse_structs  # type: ignore[attr-defined]
        fileobj = archive.fileobj
        while isextended:
            block = fileobj.read(tarfile.BLOCKSIZE)
            if len(block) < tarfile.BLOCKSIZE:
                raise tarfile.ReadError("unexpected end of data in a sparse map")
            for pos in range(0, 21 * 24, 24):
                try:
                    offset = tarfile.nti(block[pos : pos + 12])  # type: ignore[attr-defined]
                    numbytes = tarfile.nti(block[pos + 12 : pos + 24])  # type: ignore[attr-defined]
                except (ValueError, tarfile.HeaderError):
                    break
                if offset and numbytes:
                    structs.append((offset, numbytes))
            if len(structs) > MAX_SPARSE_REGIONS:
                raise self._sparse_refused(f"more than {MAX_SPARSE_REGIONS}")
            isextended = bool(block[504])
        self.sparse = structs
        self.offset_data = fileobj.tell()
        archive.offset = self.offset_data + self._block(self.size)  # type: ignore[attr-defined]
        self.size = size
        return self

    def _proc_gnusparse_00(self, next: Any, pax_headers: dict[str, str], buf: bytes) -> None:
        regions = buf.count(b" GNU.sparse.offset=")
        if regions > MAX_SPARSE_REGIONS:
            raise next._sparse_refused(regions)
        super()._proc_gnusparse_00(next, pax_headers, buf)  # type: ignore[misc]

    def _proc_gnusparse_01(self, next: Any, pax_headers: dict[str, str]) -> None:
        regions = (pax_headers["GNU.sparse.map"].count(",") + 1) // 2
        if regions > MAX_SPARSE_REGIONS:
            raise next._sparse_refused(regions)
        super()._proc_gnusparse_01(next, pax_headers)  # type: ignore[misc]

    def _proc_gnusparse_10(
        self, next: Any, pax_headers: dict[str, str], archive: tarfile.TarFile
    ) -> None:
        """GNU 1.0: the map is the entry's data, a count then that many pairs of numbers,
        one a line; read here within the bound (tarfile reads any number, any length)."""
        fileobj = archive.fileobj
        buf = fileobj.read(tarfile.BLOCKSIZE)
        count, _, buf = buf.partition(b"\n")
        if not count.isdigit() or int(count) > MAX_SPARSE_REGIONS:
            raise next._sparse_refused(count[:20].decode("ascii", "replace"))
        numbers: list[int] = []
        # 21 digits each at most (tar's own numbers are 12 octal digits, or base-256).
        budget = (int(count) * 2 + 1) * 22 + tarfile.BLOCKSIZE
        read = tarfile.BLOCKSIZE
        while len(numbers) < int(count) * 2:
            if b"\n" not in buf:
                if read >= budget:
                    raise next._sparse_refused(count.decode())
                more = fileobj.read(tarfile.BLOCKSIZE)
                if not more:
                    raise tarfile.ReadError("unexpected end of data in a sparse map")
                buf += more
                read += len(more)
            number, _, buf = buf.partition(b"\n")
            if not number.isdigit():
                raise LayerError(f"entry {next.name!r} has a malformed sparse map")
            numbers.append(int(number))
        next.offset_data = fileobj.tell()
        next.sparse = list(zip(numbers[::2], numbers[1::2], strict=True))


def sniff_compression(head: bytes) -> str:
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    return "none"


class _HashingReader:
    """A read-only stream that hashes and counts everything read through it, and stops
    at `limit` bytes: the decompressor never produces more than that for us."""

    def __init__(self, raw: IO[bytes], limit: int | None = None) -> None:
        self._raw = raw
        self.hash = hashlib.sha256()
        self.length = 0
        self.limit = limit

    def read(self, size: int = -1) -> bytes:
        if self.limit is not None:
            # Never ask for more than one byte past the limit, so that a bomb is never
            # decompressed into memory beyond it.
            room = self.limit + 1 - self.length
            size = room if size < 0 else min(size, room)
        data = self._raw.read(size)
        self.hash.update(data)
        self.length += len(data)
        if self.limit is not None and self.length > self.limit:
            raise _TooLarge(
                f"layer is larger than {format_size(self.limit)} uncompressed "
                "(images.max_layer_bytes): a decompression bomb, or raise the limit"
            )
        return data

    def drain(self) -> None:
        # tarfile stops at the end-of-archive blocks; the diff ID covers every byte.
        while self.read(_CHUNK):
            pass


@contextmanager
def _decompressed(stream: BinaryIO) -> Iterator[Any]:
    head = _peek(stream, 6)
    kind = sniff_compression(head)
    if kind == "gzip":
        with gzip.GzipFile(fileobj=stream, mode="rb") as gz:
            yield gz
    elif kind == "zstd":
        # read_across_frames: a layer may be several concatenated zstd frames.
        with zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True) as zs:
            yield zs
    elif kind == "bzip2":
        with bz2.BZ2File(stream, mode="rb") as bz:
            yield bz
    elif kind == "xz":
        with lzma.LZMAFile(stream, mode="rb") as xz:
            yield xz
    else:
        yield stream


def _peek(stream: BinaryIO, size: int) -> bytes:
    position = stream.tell()
    head = stream.read(size)
    stream.seek(position)
    return head


def unpack_layer(
    blob: Path | BinaryIO, dest: Path, policy: UnpackPolicy | None = None
) -> UnpackResult:
    """Extract the layer `blob` (a path or a seekable binary stream) into the empty or
    missing directory `dest`, refusing what `policy` does not allow. On error `dest` is
    left partly written: unpack into a temporary directory and rename it only on success
    (ImageStore does)."""
    dest.mkdir(mode=0o755, parents=True, exist_ok=True)
    policy = policy or UnpackPolicy()
    if isinstance(blob, Path):
        with blob.open("rb") as stream:
            return _unpack_stream(stream, dest, policy)
    return _unpack_stream(blob, dest, policy)


def _unpack_stream(stream: BinaryIO, dest: Path, policy: UnpackPolicy) -> UnpackResult:
    extractor: _Extractor | None = None
    try:
        with _decompressed(stream) as plain:
            reader = _HashingReader(plain, policy.max_bytes)
            extractor = _Extractor(dest, policy)
            try:
                with tarfile.open(  # type: ignore[call-overload]
                    fileobj=reader, mode="r|", tarinfo=BoundedTarInfo
                ) as archive:
                    # next(), not iteration: tarfile keeps every member it has read for
                    # getmembers(), and the iterator indexes that list; cleared after each
                    # entry, a layer costs the same memory whatever its entry count.
                    while (member := archive.next()) is not None:
                        archive.members.clear()
                        extractor.extract(archive, member)
                reader.drain()
                extractor.finish()
            finally:
                extractor.close()
    except _TooLarge as exc:
        raise LayerError(f"{exc}{_where(extractor)}") from None
    except (
        tarfile.TarError,
        EOFError,
        zstandard.ZstdError,
        OSError,
        lzma.LZMAError,
        zlib.error,
    ) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # a host problem (disk full, permissions), not a malformed archive
        raise LayerError(
            f"layer is not a valid (compressed) tar archive{_where(extractor)}: {exc}"
        ) from exc
    return UnpackResult(diff_id=f"sha256:{reader.hash.hexdigest()}", size=extractor.size)


def _where(extractor: _Extractor | None) -> str:
    """Where in the archive a stream-level error struck, for a person to find it."""
    if extractor is None or extractor.current is None:
        return ""
    return f" (in or after entry {extractor.current!r})"


def _check_numbers(member: tarfile.TarInfo) -> None:
    """A PAX header sets owner and times as decimal text, any size; the ustar fields take
    base-256 numbers of 12 bytes. Out of range they are bad input, not a failed chown."""
    for what, value in (("owner", member.uid), ("group", member.gid)):
        if not 0 <= value <= _MAX_ID:
            raise LayerError(f"entry {member.name!r} has {what} {value}, outside 0..{_MAX_ID}")
    if not (math.isfinite(member.mtime) and abs(member.mtime) <= _MAX_TIME):
        raise LayerError(f"entry {member.name!r} has mtime {member.mtime!r}, which is not a time")
    if member.size < 0:
        raise LayerError(f"entry {member.name!r} has a negative size {member.size}")
    if "\x00" in member.linkname:
        raise LayerError(f"entry {member.name!r} has a link target with a NUL byte")
    if any("\x00" in key for key in member.pax_headers):
        raise LayerError(f"entry {member.name!r} has a PAX record name with a NUL byte")


def _split(name: str, what: str) -> list[str]:
    """Archive path → components; refuses absolute paths and `..` instead of clamping them,
    because an archive that needs clamping was made to attack or is broken."""
    if len(name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES:
        raise LayerError(f"{what} {name[:64]!r}... is longer than {_MAX_NAME_BYTES} bytes")
    if name.startswith("/"):
        raise LayerError(f"{what} {name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerError(f"{what} {name!r} contains '..'")
    if "\x00" in name:
        raise LayerError(f"{what} {name!r} contains a NUL byte")
    if len(parts) > _MAX_DEPTH:
        raise LayerError(f"{what} {name[:64]!r}... is more than {_MAX_DEPTH} directories deep")
    return parts


class _Extractor:
    def __init__(self, root: Path, policy: UnpackPolicy | None = None) -> None:
        self.root = root
        self.policy = policy or UnpackPolicy()
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self.size = 0
        self.entries = 0
        self.current: str | None = None  # the entry being extracted, for error messages
        # Directory mtimes are set last: creating children would change them again. They
        # are spooled (to disk past 1MiB), not listed: one per directory would make a
        # layer's memory grow with its entry count.
        self._dir_times = tempfile.SpooledTemporaryFile(max_size=_CHUNK)

    def close(self) -> None:
        os.close(self.root_fd)
        self._dir_times.close()

    def _dir_time(self, parts: tuple[str, ...], mtime: float) -> None:
        path = "/".join(parts).encode("utf-8", "surrogateescape")
        self._dir_times.write(_DIR_TIME.pack(mtime, len(path)) + path)

    def _spooled_dir_times(self) -> Iterator[tuple[list[str], float]]:
        self._dir_times.seek(0)
        while head := self._dir_times.read(_DIR_TIME.size):
            mtime, length = _DIR_TIME.unpack(head)
            path = self._dir_times.read(length).decode("utf-8", "surrogateescape")
            yield [p for p in path.split("/") if p], mtime

    # --- path resolution -------------------------------------------------------------
    def _open_dir(self, parts: list[str], create: bool, what: str) -> int:
        """An fd for the directory `parts` under the root, never following a symlink.
        Missing directories are created (0755, root) when `create` is set. `what` names
        the entry for the error ("entry 'a/b'")."""
        fd = os.dup(self.root_fd)
        try:
            for part in parts:
                try:
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    # Not in the archive, so 0755 exactly: mkdir would inherit a setgid
                    # parent's bit and lose what the umask takes.
                    os.chmod(child, 0o755)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise LayerError(
                            f"{what} would go through {part!r}, "
                            "which is a symlink or not a directory"
                        ) from exc
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    # --- members -----------------------------------------------------------------------
    def extract(self, archive: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        """One entry; an error the entry causes is a LayerError that names it."""
        self.current = member.name
        self.entries += 1
        if self.entries > self.policy.max_entries:
            raise LayerError(
                f"layer has more than {self.policy.max_entries} entries "
                f"(images.max_layer_entries); refused at entry {member.name!r}"
            )
        _check_numbers(member)
        try:
            self._extract(archive, member)
        except (ValueError, OverflowError) as exc:
            # What the entry carries, as os.* takes it (a NUL in a link or an xattr name,
            # a number out of range): the archive's fault, not the daemon's.
            raise LayerError(f"entry {member.name!r} cannot be unpacked: {exc}") from exc
        except OSError as exc:
            if exc.errno is None or exc.errno in _HOST_ERRNOS:
                raise
            # The kernel refused what the entry asks for (a name too long, too many
            # links, an xattr it cannot hold): the archive's fault, not the host's.
            raise LayerError(f"entry {member.name!r} cannot be unpacked: {exc.strerror}") from exc

    def _extract(self, archive: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        parts = _split(member.name, "entry")
        if not parts:
            # "." or "./": the layer root itself; overlay shows the top layer's root mode.
            if member.isdir():
                self._apply_metadata(self.root_fd, None, member)
                self._dir_time((), member.mtime)
            return
        *parent, base = parts
        if base != OPAQUE_WHITEOUT and any(p.startswith(AUFS_META_PREFIX) for p in parts):
            return  # aufs bookkeeping (.wh..wh.plnk/, .wh..wh.aufs): not content
        if base.startswith(WHITEOUT_PREFIX):
            self._whiteout(parent, base, member)
            return
        parent_fd = self._open_dir(parent, create=True, what=f"entry {member.name!r}")
        try:
            self._create(archive, member, parent_fd, parent, base)
        finally:
            os.close(parent_fd)

    def _whiteout(self, parent: list[str], base: str, member: tarfile.TarInfo) -> None:
        parent_fd = self._open_dir(parent, create=True, what=f"whiteout {member.name!r}")
        try:
            if base == OPAQUE_WHITEOUT:
                os.setxattr(parent_fd, OPAQUE_XATTR, b"y")
                return
            hidden = base[len(WHITEOUT_PREFIX) :]
            if hidden in ("", ".", ".."):
                raise LayerError(f"whiteout {member.name!r} names {hidden!r}")
            self._remove_existing(parent_fd, hidden)
            os.mknod(hidden, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent_fd)
            os.chown(hidden, member.uid, member.gid, dir_fd=parent_fd, follow_symlinks=False)
        finally:
            os.close(parent_fd)

    def _remove_existing(self, parent_fd: int, base: str, keep_dir: bool = False) -> None:
        """A later entry for the same path replaces the earlier one (tar semantics)."""
        try:
            st = os.lstat(base, dir_fd=parent_fd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            shutil.rmtree(base, dir_fd=parent_fd)
        else:
            os.unlink(base, dir_fd=parent_fd)

    def _create(
        self,
        archive: tarfile.TarFile,
        member: tarfile.TarInfo,
        parent_fd: int,
        parent: list[str],
        base: str,
    ) -> None:
        self._remove_existing(parent_fd, base, keep_dir=member.isdir())
        if member.isdir():
            try:
                os.mkdir(base, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
            try:
                self._apply_metadata(fd, None, member)
            finally:
                os.close(fd)
            self._dir_time((*parent, base), member.mtime)
        elif member.isreg():
            if self.size + member.size > self.policy.max_bytes:
                # Counted apart from the stream: a sparse entry writes more than it reads.
                raise LayerError(
                    f"entry {member.name!r} takes the layer past "
                    f"{format_size(self.policy.max_bytes)} of file content "
                    "(images.max_layer_bytes): a decompression bomb, or raise the limit"
                )
            fd = os.open(
                base,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=parent_fd,
            )
            try:
                source = archive.extractfile(member)
                if source is not None:
                    with source, os.fdopen(os.dup(fd), "wb") as target:
                        shutil.copyfileobj(source, target, _CHUNK)
                self.size += member.size
                self._apply_metadata(fd, None, member)
                os.utime(fd, (member.mtime, member.mtime))
            finally:
                os.close(fd)
        elif member.issym():
            # The target is not checked: a symlink is only data here, resolved later inside
            # the container's root, and nothing in this extractor ever follows one.
            os.symlink(member.linkname, base, dir_fd=parent_fd)
            self._apply_metadata(parent_fd, base, member)
            os.utime(base, (member.mtime, member.mtime), dir_fd=parent_fd, follow_symlinks=False)
        elif member.islnk():
            self._hardlink(member, parent_fd, base)
        elif member.type in _NODE_TYPES:
            self._check_device(member)
            device = 0 if member.isfifo() else os.makedev(member.devmajor, member.devminor)
            os.mknod(base, _NODE_TYPES[member.type] | 0o600, device, dir_fd=parent_fd)
            self._apply_metadata(parent_fd, base, member)
            os.utime(base, (member.mtime, member.mtime), dir_fd=parent_fd, follow_symlinks=False)
        else:
            raise LayerError(f"entry {member.name!r} has unsupported tar type {member.type!r}")

    def _check_device(self, member: tarfile.TarInfo) -> None:
        """A device node lets whoever runs the image reach that device, were the device
        cgroup ever open (a privileged container is): only by policy. A 0/0 character
        device is overlay's whiteout, which some tools write instead of `.wh.` files."""
        if member.isfifo() or self.policy.allow_device_nodes:
            return
        if member.ischr() and member.devmajor == 0 and member.devminor == 0:
            return
        kind = "character" if member.ischr() else "block"
        raise LayerError(
            f"entry {member.name!r} is a {kind} device ({member.devmajor}:{member.devminor}); "
            "device nodes in layers are refused (images.allow_device_nodes = false)"
        )

    def _hardlink(self, member: tarfile.TarInfo, parent_fd: int, base: str) -> None:
        target = _split(member.linkname, f"hardlink {member.name!r} target")
        if not target:
            raise LayerError(f"hardlink {member.name!r} points at the layer root")
        *target_parent, target_base = target
        try:
            source_fd = self._open_dir(
                target_parent,
                create=False,
                what=f"hardlink {member.name!r} to {member.linkname!r}",
            )
        except FileNotFoundError:
            source_fd = -1
        try:
            try:
                st = os.lstat(target_base, dir_fd=source_fd) if source_fd >= 0 else None
            except FileNotFoundError:
                st = None
            if st is None:
                raise LayerError(
                    f"hardlink {member.name!r} points at {member.linkname!r}, "
                    "which is not in this layer"
                )
            if stat.S_ISDIR(st.st_mode):
                raise LayerError(f"hardlink {member.name!r} points at a directory")
            os.link(
                target_base,
                base,
                src_dir_fd=source_fd,
                dst_dir_fd=parent_fd,
                follow_symlinks=False,
            )
        finally:
            if source_fd >= 0:
                os.close(source_fd)

    def _apply_metadata(self, fd: int, name: str | None, member: tarfile.TarInfo) -> None:
        """Owner, then mode, then xattrs: chown clears setuid bits and file capabilities,
        so both must come after it. With `name`, the entry `name` in the directory `fd`
        (a symlink or device node: no xattrs); without, the open file or directory `fd`."""
        if name is None:
            os.chown(fd, member.uid, member.gid)
            os.chmod(fd, stat.S_IMODE(member.mode))
            self._set_xattrs(fd, member)
            return
        os.chown(name, member.uid, member.gid, dir_fd=fd, follow_symlinks=False)
        if not member.issym():
            # A node this extractor has just made with mknod, so following is safe (Linux
            # cannot change a symlink's own mode anyway).
            os.chmod(name, stat.S_IMODE(member.mode), dir_fd=fd)

    def _set_xattrs(self, fd: int, member: tarfile.TarInfo) -> None:
        for key, value in member.pax_headers.items():
            if not key.startswith(_PAX_XATTR):
                continue
            attribute = key[len(_PAX_XATTR) :]
            if attribute.startswith(_FORBIDDEN_XATTR_PREFIXES):
                raise LayerError(f"entry {member.name!r} sets the reserved xattr {attribute!r}")
            # tarfile decodes PAX values as UTF-8 with surrogateescape; undo it for raw bytes.
            raw = value.encode("utf-8", "surrogateescape")
            os.setxattr(fd, attribute, raw)

    def finish(self) -> None:
        # In archive order, so the last entry for a directory wins; setting a child's
        # times does not touch its parent's.
        for parts, mtime in self._spooled_dir_times():
            try:
                fd = self._open_dir(parts, create=False, what="/".join(parts))
            except (FileNotFoundError, LayerError):
                continue  # replaced by a later entry
            try:
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
