"""The local image store: blobs by digest, layers unpacked once, image records in the state DB.

On disk, under `<root>/images/`:

    blobs/sha256/<hex>          content-addressed blobs (configs, manifests, layers while
                                they wait to be unpacked); written to tmp/ and renamed into
                                place only once the digest matches
    layers/<chain-hex>/diff     one unpacked layer, keyed by its OCI chain ID, so two images
                                sharing a base share its directory; unpacked into a
                                `.tmp-*` sibling and renamed, so a `<chain-hex>` directory
                                is always complete
    tmp/                        partial blobs
    store.lock                  flock: serialises the short steps that create or delete
                                layer directories and image rows, across threads and
                                processes (`cri-shim images import` runs beside the daemon)

The `images` and `layers` tables are the index; the daemon reads them on every request, so
an image imported by another process is visible at once (SQLite WAL).

Compressed layer blobs are deleted once their layer is unpacked (as CRI-O does): the
unpacked layer is what containers use, and keeping both doubles the disk an image costs.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cri_shim.errors import FailedPrecondition, Internal, InvalidArgument, NotFound
from cri_shim.images.reference import (
    DIGEST_HEX_LENGTHS,
    Reference,
    parse_named,
    parse_reference,
    validate_digest,
)
from cri_shim.images.unpack import UnpackPolicy, unpack_layer
from cri_shim.state.db import Database

log = logging.getLogger(__name__)

# Given chain IDs, answers the ones a container still uses, so their directories are kept.
InUseHook = Callable[[Collection[str]], Collection[str]]

_ID_PREFIX = re.compile(r"(?:sha256:)?([a-f0-9]{3,64})")
_CHUNK = 1 << 20
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


class DigestMismatch(InvalidArgument):
    """Content did not hash to the digest it was announced with."""


@dataclass(frozen=True)
class LayerBlob:
    """A layer as a manifest lists it: the blob's digest and media type."""

    digest: str
    media_type: str = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclass
class ImageRecord:
    id: str  # sha256:<config digest>
    repo_tags: list[str]
    repo_digests: list[str]
    size: int
    config: dict[str, Any]
    layers: list[str]  # chain IDs, bottom first
    created_at: int  # nanoseconds since the epoch, when first stored
    manifest_digest: str = ""

    @property
    def _runtime_config(self) -> dict[str, Any]:
        value = self.config.get("config") or {}
        return value if isinstance(value, dict) else {}

    @property
    def user(self) -> str:
        return str(self._runtime_config.get("User") or "")

    @property
    def env(self) -> list[str]:
        return list(self._runtime_config.get("Env") or [])

    @property
    def entrypoint(self) -> list[str]:
        return list(self._runtime_config.get("Entrypoint") or [])

    @property
    def cmd(self) -> list[str]:
        return list(self._runtime_config.get("Cmd") or [])

    @property
    def working_dir(self) -> str:
        return str(self._runtime_config.get("WorkingDir") or "")

    @property
    def stop_signal(self) -> str:
        return str(self._runtime_config.get("StopSignal") or "")

    @property
    def volumes(self) -> list[str]:
        return sorted(self._runtime_config.get("Volumes") or {})

    @property
    def exposed_ports(self) -> list[str]:
        return sorted(self._runtime_config.get("ExposedPorts") or {})

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._runtime_config.get("Labels") or {})

    @property
    def diff_ids(self) -> list[str]:
        rootfs = self.config.get("rootfs") or {}
        return list(rootfs.get("diff_ids") or [])


@dataclass(frozen=True)
class FsInfo:
    mountpoint: Path
    used_bytes: int
    inodes_used: int

    def __iter__(self) -> Iterator[Any]:
        # So `mountpoint, used, inodes = store.fs_info()` reads naturally.
        return iter((self.mountpoint, self.used_bytes, self.inodes_used))


def chain_ids(diff_ids: Iterable[str]) -> list[str]:
    """OCI chain IDs: ChainID(L0) = DiffID(L0); ChainID(L0..n) =
    sha256(ChainID(L0..n-1) + " " + DiffID(Ln))."""
    result: list[str] = []
    for diff_id in diff_ids:
        if not result:
            result.append(diff_id)
        else:
            joined = f"{result[-1]} {diff_id}".encode()
            result.append(f"sha256:{hashlib.sha256(joined).hexdigest()}")
    return result


def _hex(digest: str) -> str:
    return digest.partition(":")[2]


def _now_ns() -> int:
    return time.time_ns()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        for directory in (self.blob_dir("sha256"), self.layers_dir, self.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()

    # --- paths -----------------------------------------------------------------------
    @property
    def images_dir(self) -> Path:
        return self._images_dir

    @property
    def layers_dir(self) -> Path:
        return self._images_dir / "layers"

    @property
    def tmp_dir(self) -> Path:
        return self._images_dir / "tmp"

    def blob_dir(self, algorithm: str) -> Path:
        return self._images_dir / "blobs" / algorithm

    def blob_path(self, digest: str) -> Path:
        validate_digest(digest, "blob digest")
        algorithm, _, hex_part = digest.partition(":")
        return self.blob_dir(algorithm) / hex_part

    def layer_path(self, chain_id: str) -> Path:
        """The layer's directory; its content is in `diff/`."""
        validate_digest(chain_id, "chain ID")
        return self.layers_dir / _hex(chain_id)

    @staticmethod
    def chain_id_of_lower_dir(path: Path) -> str:
        """The chain ID of a directory `lower_dirs` returned: lets a caller that recorded a
        container's lower dirs answer the `in_use` hook."""
        return f"sha256:{Path(path).parent.name}"

    # --- locking and crash leftovers ---------------------------------------------------
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

    def _temp_name(self) -> str:
        # The pid lets a later start tell a dead writer's leftovers from a live one's.
        return f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"

    def _remove_leftovers(self) -> None:
        for directory in (self.layers_dir, self.tmp_dir):
            for entry in directory.iterdir():
                name = entry.name
                if name.startswith(_TRASH_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
                elif name.startswith(_TMP_PREFIX):
                    pid_text = name[len(_TMP_PREFIX) :].partition("-")[0]
                    if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                        if entry.is_dir() and not entry.is_symlink():
                            shutil.rmtree(entry, ignore_errors=True)
                        else:
                            entry.unlink(missing_ok=True)

    # --- blobs -------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def read_blob(self, digest: str) -> bytes:
        try:
            return self.blob_path(digest).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found in the image store") from None

    def put_blob(
        self,
        content: bytes | IO[bytes] | Iterable[bytes],
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
        hasher = hashlib.new(algorithm)
        temp = self.tmp_dir / self._temp_name()
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

    def _remove_blob(self, digest: str) -> None:
        if digest:
            with contextlib.suppress(InvalidArgument):
                self.blob_path(digest).unlink(missing_ok=True)

    # --- layers --------------------------------------------------------------------------
    def has_layer(self, chain_id: str) -> bool:
        """Whether the layer is unpacked: then its blob need not be fetched at all."""
        return (self.layer_path(chain_id) / "diff").is_dir()

    def _unpack_to_temp(self, blob: LayerBlob, chain: str, diff_id: str) -> tuple[Path, int] | None:
        """Unpack into a temporary directory; None when the layer appeared meanwhile."""
        try:
            # Held open: a concurrent add_image of an image sharing this layer may delete
            # the blob once it has unpacked the layer itself.
            stream = self.blob_path(blob.digest).open("rb")
        except FileNotFoundError:
            if self.has_layer(chain):
                return None
            raise FailedPrecondition(
                f"layer blob {blob.digest} is not in the image store; put_blob it first"
            ) from None
        temp = self.layers_dir / self._temp_name()
        try:
            with stream:
                result = unpack_layer(stream, temp / "diff", self.unpack_policy)
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

    def _layer_sizes(self, chains: list[str]) -> dict[str, int]:
        if not chains:
            return {}
        marks = ",".join("?" * len(chains))
        rows = self.db.query(
            f"SELECT chain_id, size FROM layers WHERE chain_id IN ({marks})", tuple(chains)
        )
        return {row["chain_id"]: int(row["size"]) for row in rows}

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
        config = _parse_config(config_bytes)
        diff_ids = [validate_digest(d, "diff ID") for d in config["rootfs"]["diff_ids"]]
        if len(diff_ids) != len(layers):
            raise InvalidArgument(
                f"the image config lists {len(diff_ids)} layers (diff IDs) but the manifest "
                f"has {len(layers)}"
            )
        tags = [_tag_string(t) for t in repo_tags]
        digests = [_repo_digest_string(d) for d in repo_digests]
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
                        unpacked = self._unpack_to_temp(blob, chain, diff_id)
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
                self._remove_blob(blob.digest)
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
        sizes: dict[str, int] = {}
        for chain, (temp, size) in pending.items():
            final = self.layer_path(chain)
            if (final / "diff").is_dir():
                shutil.rmtree(temp, ignore_errors=True)  # another writer got there first
            else:
                if final.exists():  # a directory without diff/: debris, never a layer
                    self._trash(final)
                os.rename(temp, final)
            sizes[chain] = size
        now = _now_ns()
        with self.db.transaction() as conn:
            known = self._layer_sizes(chains)
            parent: str | None = None
            for chain, diff_id in zip(chains, diff_ids, strict=True):
                if chain not in known:
                    # A directory left by a crash after its rename but before this row: it
                    # is complete (renames are atomic); measure it rather than unpack again.
                    if chain in sizes:
                        size = sizes[chain]
                    else:
                        size = _tree_size(self.layer_path(chain) / "diff")
                    conn.execute(
                        "INSERT INTO layers (chain_id, diff_id, parent, path, size, created_at)"
                        " VALUES (?, ?, ?, ?, ?, ?)",
                        (chain, diff_id, parent, str(self.layer_path(chain)), size, now),
                    )
                    known[chain] = size
                parent = chain
            existing = self._get_by_id(image_id)
            if existing is not None:
                tags = _union(existing.repo_tags, tags)
                digests = _union(existing.repo_digests, digests)
                manifest_digest = existing.manifest_digest or manifest_digest
                created_at = existing.created_at
            else:
                created_at = now
            record = ImageRecord(
                id=image_id,
                repo_tags=tags,
                repo_digests=digests,
                size=sum(known[c] for c in chains),
                config=config,
                layers=chains,
                created_at=created_at,
                manifest_digest=manifest_digest,
            )
            self._take_references(image_id, tags, digests)
            conn.execute(
                "INSERT OR REPLACE INTO images (id, repo_tags, repo_digests, size,"
                " manifest_digest, config, layers, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    json.dumps(record.repo_tags),
                    json.dumps(record.repo_digests),
                    record.size,
                    record.manifest_digest,
                    json.dumps(record.config),
                    json.dumps(record.layers),
                    record.created_at,
                ),
            )
        return record

    def _take_references(self, image_id: str, tags: list[str], digests: list[str]) -> None:
        """Strip `tags` and `digests` from every other image (inside a transaction): a tag
        names one image at a time, and the newest assignment wins, as with docker."""
        wanted = set(tags) | set(digests)
        if not wanted:
            return
        marks = ",".join("?" * len(wanted))
        rows = self.db.query(
            "SELECT DISTINCT images.* FROM images, json_each(images.repo_tags) AS t "
            f"WHERE t.value IN ({marks}) AND images.id != ? "
            "UNION SELECT DISTINCT images.* FROM images, json_each(images.repo_digests) AS d "
            f"WHERE d.value IN ({marks}) AND images.id != ?",
            (*wanted, image_id, *wanted, image_id),
        )
        for row in rows:
            other = _record(row)
            self.db.execute(
                "UPDATE images SET repo_tags = ?, repo_digests = ? WHERE id = ?",
                (
                    json.dumps([t for t in other.repo_tags if t not in wanted]),
                    json.dumps([d for d in other.repo_digests if d not in wanted]),
                    other.id,
                ),
            )

    # --- lookups -----------------------------------------------------------------------
    def _get_by_id(self, image_id: str) -> ImageRecord | None:
        row = self.db.query_one("SELECT * FROM images WHERE id = ?", (image_id,))
        return _record(row) if row is not None else None

    def _find_by(self, column: str, value: str) -> ImageRecord | None:
        row = self.db.query_one(
            f"SELECT images.* FROM images, json_each(images.{column}) AS r WHERE r.value = ?",
            (value,),
        )
        return _record(row) if row is not None else None

    def _find_by_id_prefix(self, prefix: str, ref: str) -> ImageRecord | None:
        rows = self.db.query(
            "SELECT * FROM images WHERE id >= ? AND id < ? LIMIT 2",
            (f"sha256:{prefix}", f"sha256:{prefix}g"),  # 'g' sorts after every hex digit
        )
        if len(rows) > 1:
            raise InvalidArgument(f"image ID prefix {ref!r} is ambiguous: use more digits")
        return _record(rows[0]) if rows else None

    def get(self, ref: str) -> ImageRecord | None:
        """The image `ref` names, or None. `ref` is a tag (normalised: `busybox` is
        `docker.io/library/busybox:latest`), a repo digest (`name@sha256:…`), an image ID
        (`sha256:<hex>` or 64 hex) or a unique ID prefix of at least 3 hex digits.
        A reference that is not valid raises `InvalidArgument`."""
        ref = ref.strip()
        id_match = _ID_PREFIX.fullmatch(ref)
        if ref.startswith("sha256:"):
            if id_match is None:
                validate_digest(ref, "image ID")  # raises with the reason
                raise InvalidArgument(f"invalid image ID {ref!r}")
            prefix = id_match.group(1)
            if len(prefix) == DIGEST_HEX_LENGTHS["sha256"]:
                return self._get_by_id(ref)
            return self._find_by_id_prefix(prefix, ref)
        if id_match is not None and len(ref) == DIGEST_HEX_LENGTHS["sha256"]:
            return self._get_by_id(f"sha256:{ref}")
        try:
            parsed = parse_reference(ref)
        except InvalidArgument:
            if id_match is not None:  # e.g. "0a1b2c…" that is not a valid name
                return self._find_by_id_prefix(ref, ref)
            raise
        record = self._get_by_reference(parsed)
        if record is None and id_match is not None:
            # docker's order: a name first, then an ID prefix ("abc" may be either).
            record = self._find_by_id_prefix(ref, ref)
        return record

    def _get_by_reference(self, ref: Reference) -> ImageRecord | None:
        if ref.digest is not None:
            # The digest identifies; a tag next to it (`repo:tag@sha256:…`) is ignored.
            return self._find_by("repo_digests", f"{ref.name}@{ref.digest}")
        return self._find_by("repo_tags", ref.string())

    def resolve(self, ref: str) -> ImageRecord:
        """Like `get`, but an unknown image raises `NotFound` naming `ref`."""
        record = self.get(ref)
        if record is None:
            raise NotFound(f"image {ref!r} not found")
        return record

    def list(self, filter_ref: str | None = None) -> list[ImageRecord]:
        """All images, oldest first; or those `filter_ref` names. A filter without a tag
        (`busybox`) matches every tag and digest of that repository, as `crictl images
        busybox` expects; with a tag, digest or ID it matches one image."""
        if not filter_ref:
            rows = self.db.query("SELECT * FROM images ORDER BY created_at, id")
            return [_record(row) for row in rows]
        try:
            named = parse_named(filter_ref)
        except InvalidArgument:
            named = None
        if named is not None and named.tag is None and named.digest is None:
            prefix_tag, prefix_digest = f"{named.name}:", f"{named.name}@"
            return [
                image
                for image in self.list()
                if any(t.startswith(prefix_tag) for t in image.repo_tags)
                or any(d.startswith(prefix_digest) for d in image.repo_digests)
            ]
        try:
            record = self.get(filter_ref)
        except InvalidArgument:
            return []
        return [record] if record is not None else []

    # --- tags, removal, garbage collection ---------------------------------------------
    def tag(self, image_id: str, ref: str) -> ImageRecord:
        """Point the tag `ref` at the image `image_id` (any form `resolve` takes), taking
        it from whichever image had it."""
        tag = _tag_string(ref)
        with self.db.transaction():
            record = self.resolve(image_id)
            if tag in record.repo_tags:
                return record
            self._take_references(record.id, [tag], [])
            record.repo_tags.append(tag)
            self.db.execute(
                "UPDATE images SET repo_tags = ? WHERE id = ?",
                (json.dumps(record.repo_tags), record.id),
            )
        return record

    def remove(self, ref: str, in_use: InUseHook | None = None) -> ImageRecord | None:
        """Remove the image `ref` names, with all its tags; an unknown image is no error
        (CRI RemoveImage is idempotent). Layers that no other image uses are deleted,
        except those the `in_use` hook (or the store's) reports a container still uses;
        `gc_layers` collects those later."""
        with self._locked():
            with self.db.transaction():
                record = self.get(ref)
                if record is None:
                    return None
                self.db.execute("DELETE FROM images WHERE id = ?", (record.id,))
            self._collect_layers(record.layers, in_use or self.in_use)
            # A manifest names exactly one config, so this image's manifests are its own.
            manifests = {
                record.manifest_digest,
                *(d.partition("@")[2] for d in record.repo_digests),
            }
            for digest in {record.id, *manifests}:
                self._remove_blob(digest)
        log.info("image %s removed (tags %s)", record.id, record.repo_tags)
        return record

    def gc_layers(self, in_use: InUseHook | None = None) -> builtins.list[str]:
        """Delete every layer no image references and no container uses; returns their
        chain IDs. Call it after a container using a removed image's layers is gone."""
        with self._locked():
            rows = self.db.query("SELECT chain_id FROM layers")
            return self._collect_layers([row["chain_id"] for row in rows], in_use or self.in_use)

    def _collect_layers(
        self, candidates: Iterable[str], in_use: InUseHook | None
    ) -> builtins.list[str]:
        """Under the store lock."""
        referenced: set[str] = set()
        for row in self.db.query("SELECT layers FROM images"):
            referenced.update(json.loads(row["layers"]))
        unused = [c for c in dict.fromkeys(candidates) if c not in referenced]
        if unused and in_use is not None:
            busy = set(in_use(unused))
            unused = [c for c in unused if c not in busy]
        for chain in unused:
            # Rename first: a `<chain-hex>` directory must never be seen half-deleted.
            self._trash(self.layer_path(chain))
            self.db.execute("DELETE FROM layers WHERE chain_id = ?", (chain,))
        if unused:
            log.info("layers collected: %s", unused)
        return unused

    def _trash(self, path: Path) -> None:
        trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    # --- what the runtime needs --------------------------------------------------------
    def lower_dirs(self, image: ImageRecord | str) -> builtins.list[Path]:
        """The image's layer directories, top layer first, as overlayfs `lowerdir` wants."""
        record = image if isinstance(image, ImageRecord) else self.resolve(image)
        dirs = []
        for chain in reversed(record.layers):
            diff = self.layer_path(chain) / "diff"
            if not diff.is_dir():
                raise FailedPrecondition(
                    f"image {record.id}: layer {chain} is missing from {self.layers_dir}; "
                    "remove the image and pull or import it again"
                )
            dirs.append(diff)
        return dirs

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


# --- helpers ---------------------------------------------------------------------------
def _chunks(content: bytes | IO[bytes] | Iterable[bytes]) -> Iterator[bytes]:
    if isinstance(content, bytes | bytearray | memoryview):
        yield bytes(content)
        return
    read = getattr(content, "read", None)
    if read is not None:
        while chunk := read(_CHUNK):
            yield chunk
        return
    yield from content


def _parse_config(config_bytes: bytes) -> dict[str, Any]:
    try:
        config = json.loads(config_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"image config is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidArgument("image config is not a JSON object")
    rootfs = config.get("rootfs")
    if not isinstance(rootfs, dict) or not isinstance(rootfs.get("diff_ids"), list):
        raise InvalidArgument("image config has no rootfs.diff_ids")
    return config


def _tag_string(ref: str) -> str:
    parsed = parse_reference(ref)
    if parsed.digest is not None:
        raise InvalidArgument(f"{ref!r} is a digest reference, not a tag")
    return parsed.string()


def _repo_digest_string(ref: str) -> str:
    parsed = parse_named(ref)
    if parsed.digest is None:
        raise InvalidArgument(f"repo digest {ref!r} has no @digest")
    return f"{parsed.name}@{parsed.digest}"


def _union(first: list[str], second: list[str]) -> list[str]:
    return list(dict.fromkeys([*first, *second]))


def _record(row: Any) -> ImageRecord:
    return ImageRecord(
        id=row["id"],
        repo_tags=json.loads(row["repo_tags"]),
        repo_digests=json.loads(row["repo_digests"]),
        size=int(row["size"]),
        config=json.loads(row["config"]),
        layers=json.loads(row["layers"]),
        created_at=int(row["created_at"]),
        manifest_digest=row["manifest_digest"],
    )


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
