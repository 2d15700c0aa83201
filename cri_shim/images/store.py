"""The local image store: content, layers and images composed, as containerd separates them.

On disk, under `<root>/images/`:

    blobs/, tmp/                content by digest (`content.ContentStore`)
    layers/<chain-hex>/diff     layers unpacked once (`layers.LayerStore`)
    store.lock                  flock: serialises the short steps that create or delete
                                layer directories and image rows, across threads and
                                processes (`cri-shim images import` runs beside the daemon)

The `images` and `layers` tables are the index (`catalog.ImageCatalog` and the layer
store); the daemon reads them on every request, so an image imported by another process is
visible at once (SQLite WAL).

Compressed layer blobs are deleted once their layer is unpacked (as CRI-O does): the
unpacked layer is what containers use, and keeping both doubles the disk an image costs.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cri_shim import tracing
from cri_shim.errors import Internal, InvalidArgument
from cri_shim.images.catalog import (
    ImageCatalog,
    parse_config,
    repo_digest_string,
    tag_string,
)
from cri_shim.images.content import ContentStore
from cri_shim.images.layers import InUseHook, LayerBlob, LayerStore, chain_ids
from cri_shim.images.policy import UnpackPolicy
from cri_shim.images.reference import validate_digest
from cri_shim.state.db import Database
from cri_shim.state.records import ImageRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FsInfo:
    mountpoint: Path
    used_bytes: int
    inodes_used: int

    def __iter__(self) -> Iterator[Any]:
        # So `mountpoint, used, inodes = store.fs_info()` reads naturally.
        return iter((self.mountpoint, self.used_bytes, self.inodes_used))


class ImageStore:
    """See the module docstring. Methods are synchronous and thread-safe; the daemon
    calls the slow ones (`add_image`, `remove`, `fs_info`) from a worker thread. Do not
    call the mutators inside an open `Database.transaction()`: they take the store lock."""

    def __init__(
        self,
        root: Path,
        db: Database,
        in_use: InUseHook | None = None,
        keep_layer_blobs: bool = False,
        unpack_policy: UnpackPolicy | None = None,
    ) -> None:
        self.root = root
        self.db = db
        self.in_use = in_use
        self.keep_layer_blobs = keep_layer_blobs
        # What a layer may hold ([images] limits and device policy); pulls and imports
        # both unpack through this store, so both obey it.
        self.unpack_policy = unpack_policy or UnpackPolicy()
        self._images_dir = root / "images"
        self.content = ContentStore(self._images_dir)
        self.layers = LayerStore(self._images_dir, db, self.content, self.unpack_policy)
        self.catalog = ImageCatalog(db)
        # What callers holding the image store use of the content and layer stores.
        self.blob_dir = self.content.blob_dir
        self.blob_path = self.content.blob_path
        self.has_blob = self.content.has_blob
        self.read_blob = self.content.read_blob
        self.put_blob = self.content.put_blob
        self.layer_path = self.layers.layer_path
        self.has_layer = self.layers.has_layer

    # --- paths -----------------------------------------------------------------------
    @property
    def images_dir(self) -> Path:
        return self._images_dir

    @property
    def layers_dir(self) -> Path:
        return self.layers.layers_dir

    @property
    def tmp_dir(self) -> Path:
        return self.content.tmp_dir

    chain_id_of_lower_dir = staticmethod(LayerStore.chain_id_of_lower_dir)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # A fresh open file description each time: flock then excludes other threads of
        # this process as well as other processes.
        fd = os.open(self._images_dir / "store.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # --- adding images -----------------------------------------------------------------
    def add_image(
        self,
        config_bytes: bytes,
        layer_blobs: Iterable[LayerBlob | tuple[str, str]],
        manifest_digest: str = "",
        repo_tags: Iterable[str] = (),
        repo_digests: Iterable[str] = (),
        manifest_bytes: bytes | None = None,
    ) -> ImageRecord:
        """Record an image whose layer blobs are in the store (`put_blob`), unpacking each
        layer that is not unpacked yet. A layer already unpacked needs no blob. Tags held
        by another image move to this one. Adding an image that exists merges its tags."""
        layers = [b if isinstance(b, LayerBlob) else LayerBlob(*b) for b in layer_blobs]
        config = parse_config(config_bytes)
        diff_ids = [validate_digest(d, "diff ID") for d in config["rootfs"]["diff_ids"]]
        if len(diff_ids) != len(layers):
            raise InvalidArgument(
                f"the image config lists {len(diff_ids)} layers (diff IDs) but the manifest "
                f"has {len(layers)}"
            )
        tags = [tag_string(t) for t in repo_tags]
        digests = [repo_digest_string(d) for d in repo_digests]
        if manifest_digest:
            validate_digest(manifest_digest, "manifest digest")
        image_id = self.put_blob(config_bytes)
        if manifest_bytes is not None:
            self.put_blob(manifest_bytes, manifest_digest or None)
        chains = chain_ids(diff_ids)

        # Unpacking is slow and runs unlocked; committing is quick and locked. A layer seen
        # present here may be collected before the commit, so the commit checks again and
        # the loop unpacks whatever went missing (at most a few rounds in practice).
        pending: dict[str, tuple[Path, int]] = {}
        try:
            for _round in range(5):
                for chain, diff_id, blob in zip(chains, diff_ids, layers, strict=True):
                    if chain not in pending and not self.has_layer(chain):
                        with tracing.span("layer unpack", **{"oci.layer.diff_id": diff_id}):
                            unpacked = self.layers.unpack_to_temp(blob, chain, diff_id)
                        if unpacked is not None:
                            pending[chain] = unpacked
                with self._locked():
                    missing = [c for c in chains if c not in pending and not self.has_layer(c)]
                    if missing:
                        continue
                    record = self._commit(
                        image_id, config, chains, diff_ids, pending, manifest_digest, tags, digests
                    )
                    pending.clear()
                break
            else:
                raise Internal(f"image {image_id}: its layers kept disappearing while adding it")
        finally:
            for temp, _size in pending.values():
                shutil.rmtree(temp, ignore_errors=True)
        if not self.keep_layer_blobs:
            for blob in layers:
                self.content.remove_blob(blob.digest)
        log.info("image %s stored, tags %s", image_id, record.repo_tags)
        return record

    def _commit(
        self,
        image_id: str,
        config: dict[str, Any],
        chains: list[str],
        diff_ids: list[str],
        pending: dict[str, tuple[Path, int]],
        manifest_digest: str,
        tags: list[str],
        digests: list[str],
    ) -> ImageRecord:
        """Under the store lock: move unpacked layers into place, then write the rows."""
        sizes = self.layers.move_into_place(pending)
        now = time.time_ns()
        with self.db.transaction():
            known = self.layers.record(chains, diff_ids, sizes, now)
            return self.catalog.put(
                image_id,
                config,
                chains,
                sum(known[c] for c in chains),
                manifest_digest,
                tags,
                digests,
                now,
            )

    # --- lookups -----------------------------------------------------------------------
    def get(self, ref: str) -> ImageRecord | None:
        """See `ImageCatalog.get`: by tag, repo digest, ID or unique ID prefix."""
        return self.catalog.get(ref)

    def resolve(self, ref: str) -> ImageRecord:
        """Like `get`, but an unknown image raises `NotFound` naming `ref`."""
        return self.catalog.resolve(ref)

    def list(self, filter_ref: str | None = None) -> builtins.list[ImageRecord]:
        """See `ImageCatalog.list`."""
        return self.catalog.list(filter_ref)

    # --- tags, removal, garbage collection ---------------------------------------------
    def tag(self, image_id: str, ref: str) -> ImageRecord:
        """Point the tag `ref` at the image `image_id` (any form `resolve` takes), taking
        it from whichever image had it."""
        return self.catalog.tag(image_id, ref)

    def remove(self, ref: str, in_use: InUseHook | None = None) -> ImageRecord | None:
        """Remove the image `ref` names, with all its tags; an unknown image is no error
        (CRI RemoveImage is idempotent). Layers that no other image uses are deleted,
        except those the `in_use` hook (or the store's) reports a container still uses;
        `gc_layers` collects those later."""
        with self._locked():
            record = self.catalog.delete(ref)
            if record is None:
                return None
            self._collect_layers(record.layers, in_use or self.in_use)
            # A manifest names exactly one config, so this image's manifests are its own.
            manifests = {
                record.manifest_digest,
                *(d.partition("@")[2] for d in record.repo_digests),
            }
            for digest in {record.id, *manifests}:
                self.content.remove_blob(digest)
        log.info("image %s removed (tags %s)", record.id, record.repo_tags)
        return record

    def gc_layers(self, in_use: InUseHook | None = None) -> builtins.list[str]:
        """Delete every layer no image references and no container uses; returns their
        chain IDs. Call it after a container using a removed image's layers is gone."""
        with self._locked():
            return self._collect_layers(self.layers.all_chain_ids(), in_use or self.in_use)

    def _collect_layers(
        self, candidates: Iterable[str], in_use: InUseHook | None
    ) -> builtins.list[str]:
        """Under the store lock."""
        return self.layers.collect(candidates, self.catalog.referenced_layers(), in_use)

    # --- what the runtime needs --------------------------------------------------------
    def lower_dirs(self, image: ImageRecord | str) -> builtins.list[Path]:
        """The image's layer directories, top layer first, as overlayfs `lowerdir` wants."""
        record = image if isinstance(image, ImageRecord) else self.resolve(image)
        return self.layers.lower_dirs(record.id, record.layers)

    def fs_info(self) -> FsInfo:
        """What the image filesystem uses: (mountpoint, bytes, inodes), counting each inode
        once (layers hold hardlinks)."""
        seen: set[tuple[int, int]] = set()
        used = 0
        for dirpath, dirnames, filenames in os.walk(self._images_dir):
            for name in [*dirnames, *filenames]:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                used += st.st_blocks * 512
        return FsInfo(self._images_dir, used, len(seen))
