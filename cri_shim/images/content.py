"""Content: blobs (configs, manifests, layers waiting to be unpacked) stored by digest.

blobs/<algorithm>/<hex>     written to tmp/ and renamed into place only once the
                            digest matches, so a blob under its digest is always whole
tmp/                        partial blobs
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from cri_shim.errors import InvalidArgument, NotFound
from cri_shim.images.reference import validate_digest
from cri_shim.images.scratch import remove_leftovers, temp_name

_CHUNK = 1 << 20

# What a blob can be given as: bytes, a binary stream, or chunks (such as an HTTP body).
BlobContent = bytes | IO[bytes] | Iterable[bytes]


class DigestMismatch(InvalidArgument):
    """Content did not hash to the digest it was announced with."""


class ContentStore:
    """Blobs under `<images_dir>/blobs`; thread- and process-safe without a lock, as every
    blob appears by an atomic rename and is identified by its content."""

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = images_dir
        for directory in (self.blob_dir("sha256"), self.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.tmp_dir)

    @property
    def tmp_dir(self) -> Path:
        return self.images_dir / "tmp"

    def blob_dir(self, algorithm: str) -> Path:
        return self.images_dir / "blobs" / algorithm

    def blob_path(self, digest: str) -> Path:
        validate_digest(digest, "blob digest")
        algorithm, _, hex_part = digest.partition(":")
        return self.blob_dir(algorithm) / hex_part

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def read_blob(self, digest: str) -> bytes:
        try:
            return self.blob_path(digest).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found in the image store") from None

    def put_blob(
        self,
        content: BlobContent,
        expected_digest: str | None = None,
        expected_size: int | None = None,
    ) -> str:
        """Store `content` (bytes, a binary stream, or an iterable of chunks such as an
        HTTP body) and return its digest. With `expected_digest`, content that hashes to
        anything else is refused with `DigestMismatch` and never becomes visible. A blob
        already present is not written again (a stream is then left unread)."""
        algorithm = "sha256"
        if expected_digest is not None:
            validate_digest(expected_digest, "blob digest")
            algorithm = expected_digest.partition(":")[0]
            if self.has_blob(expected_digest):
                return expected_digest
        import hashlib  # OpenSSL's: loaded with the first blob stored (host/ssl_on_demand.py)

        hasher = hashlib.new(algorithm)
        temp = self.tmp_dir / temp_name()
        written = 0
        try:
            with temp.open("xb") as out:
                for chunk in _chunks(content):
                    hasher.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = f"{algorithm}:{hasher.hexdigest()}"
            if expected_digest is not None and digest != expected_digest:
                raise DigestMismatch(
                    f"content of blob {expected_digest} hashes to {digest}: "
                    "corrupted or not the blob it claims to be"
                )
            if expected_size is not None and written != expected_size:
                raise DigestMismatch(
                    f"blob {digest} is {written} bytes, but {expected_size} were announced"
                )
            final = self.blob_path(digest)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        return digest

    def remove_blob(self, digest: str) -> None:
        """Delete the blob if it is there; "" or a digest that is not valid is ignored."""
        if digest:
            with contextlib.suppress(InvalidArgument):
                self.blob_path(digest).unlink(missing_ok=True)


def _chunks(content: BlobContent) -> Iterator[bytes]:
    if isinstance(content, bytes | bytearray | memoryview):
        yield bytes(content)
        return
    read = getattr(content, "read", None)
    if read is not None:
        while chunk := read(_CHUNK):
            yield chunk
        return
    yield from content
