"""Layers: each image layer unpacked once into a directory keyed by its OCI chain ID.

    layers/<chain-hex>/diff     one unpacked layer, so two images sharing a base share its
                                directory; unpacked into a `.tmp-*` sibling and renamed,
                                so a `<chain-hex>` directory is always complete

The `layers` table records each directory with its parent and size. Which layers an image
uses is the image's (`catalog`); which of them a container still uses is the caller's
(the `in_use` hook).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from cri_shim.errors import FailedPrecondition, Internal, InvalidArgument
from cri_shim.images.content import ContentStore, DigestMismatch
from cri_shim.images.policy import UnpackPolicy
from cri_shim.images.reference import validate_digest
from cri_shim.images.scratch import remove_leftovers, temp_name, trash
from cri_shim.state.db import Database
from cri_shim.state.images import LayerRows

log = logging.getLogger(__name__)

# Given chain IDs, answers the ones a container still uses, so their directories are kept.
InUseHook = Callable[[Collection[str]], Collection[str]]


@dataclass(frozen=True)
class LayerBlob:
    """A layer as a manifest lists it: the blob's digest and media type."""

    digest: str
    media_type: str = "application/vnd.oci.image.layer.v1.tar+gzip"


def chain_ids(diff_ids: Iterable[str]) -> list[str]:
    """OCI chain IDs: ChainID(L0) = DiffID(L0); ChainID(L0..n) =
    sha256(ChainID(L0..n-1) + " " + DiffID(Ln))."""
    import hashlib  # OpenSSL's: loaded with the first image stored (host/ssl_on_demand.py)

    result: list[str] = []
    for diff_id in diff_ids:
        if not result:
            result.append(diff_id)
        else:
            joined = f"{result[-1]} {diff_id}".encode()
            result.append(f"sha256:{hashlib.sha256(joined).hexdigest()}")
    return result


class LayerStore:
    """Layer directories under `<images_dir>/layers` and their rows. Creating and deleting
    them (`move_into_place`, `collect`) must run under the image store's lock."""

    def __init__(
        self, images_dir: Path, db: Database, content: ContentStore, policy: UnpackPolicy
    ) -> None:
        self.layers_dir = images_dir / "layers"
        self.db = db
        self.rows = LayerRows(db)
        self.content = content
        self.policy = policy
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.layers_dir)

    def layer_path(self, chain_id: str) -> Path:
        """The layer's directory; its content is in `diff/`."""
        validate_digest(chain_id, "chain ID")
        return self.layers_dir / chain_id.partition(":")[2]

    @staticmethod
    def chain_id_of_lower_dir(path: Path) -> str:
        """The chain ID of a directory `lower_dirs` returned: lets a caller that recorded a
        container's lower dirs answer the `in_use` hook."""
        return f"sha256:{Path(path).parent.name}"

    def has_layer(self, chain_id: str) -> bool:
        """Whether the layer is unpacked: then its blob need not be fetched at all."""
        return (self.layer_path(chain_id) / "diff").is_dir()

    def unpack_to_temp(self, blob: LayerBlob, chain: str, diff_id: str) -> tuple[Path, int] | None:
        """Unpack into a temporary directory; None when the layer appeared meanwhile."""
        try:
            # Held open: a concurrent add_image of an image sharing this layer may delete
            # the blob once it has unpacked the layer itself.
            stream = self.content.blob_path(blob.digest).open("rb")
        except FileNotFoundError:
            if self.has_layer(chain):
                return None
            raise FailedPrecondition(
                f"layer blob {blob.digest} is not in the image store; put_blob it first"
            ) from None
        # tarfile and zstd (~1 MiB) are imported by the first pull, not by every daemon.
        from cri_shim.images.unpack import unpack_layer

        temp = self.layers_dir / temp_name()
        try:
            with stream:
                result = unpack_layer(stream, temp / "diff", self.policy)
            if result.diff_id != diff_id:
                raise DigestMismatch(
                    f"layer {blob.digest} unpacks to diff ID {result.diff_id}, "
                    f"but the image config says {diff_id}"
                )
        except InvalidArgument as exc:
            shutil.rmtree(temp, ignore_errors=True)
            raise type(exc)(f"layer {blob.digest}: {exc}") from exc
        except OSError as exc:  # the host's fault (disk full, not root), not the layer's
            shutil.rmtree(temp, ignore_errors=True)
            raise Internal(f"unpacking layer {blob.digest} into {temp}: {exc}") from exc
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return temp, result.size

    def move_into_place(self, pending: dict[str, tuple[Path, int]]) -> dict[str, int]:
        """Under the store lock: rename unpacked layers to their final directories; returns
        their sizes by chain ID."""
        sizes: dict[str, int] = {}
        for chain, (temp, size) in pending.items():
            final = self.layer_path(chain)
            if (final / "diff").is_dir():
                shutil.rmtree(temp, ignore_errors=True)  # another writer got there first
            else:
                if final.exists():  # a directory without diff/: debris, never a layer
                    trash(final)
                os.rename(temp, final)
            sizes[chain] = size
        return sizes

    def record(
        self, chains: list[str], diff_ids: list[str], sizes: dict[str, int], now: int
    ) -> dict[str, int]:
        """Inside a transaction: a row for each of `chains` that has none (`sizes` has the
        ones just unpacked); returns the size of every one of them."""
        known = self.rows.sizes(chains)
        parent: str | None = None
        for chain, diff_id in zip(chains, diff_ids, strict=True):
            if chain not in known:
                # A directory left by a crash after its rename but before this row: it
                # is complete (renames are atomic); measure it rather than unpack again.
                if chain in sizes:
                    size = sizes[chain]
                else:
                    size = _tree_size(self.layer_path(chain) / "diff")
                self.rows.add(chain, diff_id, parent, str(self.layer_path(chain)), size, now)
                known[chain] = size
            parent = chain
        return known

    def all_chain_ids(self) -> list[str]:
        return self.rows.chain_ids()

    def collect(
        self, candidates: Iterable[str], referenced: Collection[str], in_use: InUseHook | None
    ) -> list[str]:
        """Under the store lock: delete those of `candidates` that no image references and
        `in_use` does not report; returns their chain IDs."""
        unused = [c for c in dict.fromkeys(candidates) if c not in referenced]
        if unused and in_use is not None:
            busy = set(in_use(unused))
            unused = [c for c in unused if c not in busy]
        for chain in unused:
            # Rename first: a `<chain-hex>` directory must never be seen half-deleted.
            trash(self.layer_path(chain))
            self.rows.delete(chain)
        if unused:
            log.info("layers collected: %s", unused)
        return unused

    def lower_dirs(self, image_id: str, chains: list[str]) -> list[Path]:
        """The `diff/` directories of `chains` (bottom first), top layer first, as overlayfs
        `lowerdir` wants."""
        dirs = []
        for chain in reversed(chains):
            diff = self.layer_path(chain) / "diff"
            if not diff.is_dir():
                raise FailedPrecondition(
                    f"image {image_id}: layer {chain} is missing from {self.layers_dir}; "
                    "remove the image and pull or import it again"
                )
            dirs.append(diff)
        return dirs


def _tree_size(path: Path) -> int:
    seen: set[int] = set()
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino not in seen and stat.S_ISREG(st.st_mode):
                seen.add(st.st_ino)
                total += st.st_size
    return total
