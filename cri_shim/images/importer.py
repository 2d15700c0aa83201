"""Importing images from files: an OCI image layout (a directory), an OCI archive (a tar of
one), or a docker-archive (`docker save`). Also the `cri-shim images import` command.

Every blob is checked against its digest on the way into the store. A layer that is
already unpacked is not copied at all.

Naming an OCI image: the full name in `io.containerd.image.name`, or in
`org.opencontainers.image.ref.name` when that is a full reference. A ref.name that is only
a tag (`latest`, as `skopeo copy … oci:dir:latest` writes) has no repository, so without
`--name` the image is imported untagged (reachable by its ID). `--name` wins over the
file; when it has no tag of its own, the file's tag is kept (`--name quay.io/x` with
ref.name `1.2` gives `quay.io/x:1.2`), else `latest`. For a docker-archive, `--name`
replaces the RepoTags.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Protocol

from cri_shim.errors import CriError, InvalidArgument
from cri_shim.images.layers import LayerBlob, chain_ids
from cri_shim.images.manifest import (
    CONTAINERD_NAME_ANNOTATION,
    DOCKER_LAYER,
    DOCKER_LAYER_GZIP,
    INDEX_TYPES,
    MANIFEST_TYPES,
    REF_NAME_ANNOTATION,
    Descriptor,
    host_platform,
    is_attestation,
    media_type_of,
    parse_index,
    parse_manifest,
    platform_matches,
    select_platform,
)
from cri_shim.images.policy import UnpackPolicy
from cri_shim.images.reference import parse_named, parse_reference
from cri_shim.images.store import ImageStore
from cri_shim.images.unpack import BoundedTarInfo, sniff_compression
from cri_shim.state.records import ImageRecord

log = logging.getLogger(__name__)

# Manifests, indexes and configs are small; a bigger "JSON" file is a mistake or an attack.
_MAX_JSON = 16 << 20
# An image archive holds a few entries per layer and blob; the index of them is in memory.
_MAX_ARCHIVE_ENTRIES = 100_000


class _Source(Protocol):
    """Files of a layout or archive, by their path inside it."""

    description: str

    def exists(self, name: str) -> bool: ...

    def open(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]: ...


def _inner_path(name: str, source: str) -> str:
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or not parts:
        raise InvalidArgument(f"{source}: path {name!r} points outside the archive")
    return "/".join(parts)


def _resolve_inside(base: PurePosixPath, link: str, source: str) -> str:
    """A symlink target inside an archive, resolved lexically, never above its root."""
    parts: list[str] = [] if link.startswith("/") else list(base.parts)
    for part in PurePosixPath(link).parts:
        if part in ("/", "", "."):
            continue
        if part == "..":
            if not parts:
                raise InvalidArgument(f"{source}: symlink {link!r} points outside the archive")
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


class _DirSource:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.description = str(root)

    def exists(self, name: str) -> bool:
        return (self.root / _inner_path(name, self.description)).is_file()

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        path = self.root / _inner_path(name, self.description)
        try:
            stream = path.open("rb")
        except FileNotFoundError:
            raise InvalidArgument(f"{self.description}: {name} is missing") from None
        with stream:
            yield stream


class _TarSource:
    def __init__(self, archive: tarfile.TarFile, description: str) -> None:
        self.archive = archive
        self.description = description
        # Later entries win, as when the tar is extracted.
        self.members: dict[str, tarfile.TarInfo] = {}
        for count, member in enumerate(iter(archive.next, None), 1):
            if count > _MAX_ARCHIVE_ENTRIES:
                raise InvalidArgument(
                    f"{description}: more than {_MAX_ARCHIVE_ENTRIES} entries; an image "
                    "archive holds a few per layer"
                )
            parts = PurePosixPath(member.name).parts
            self.members["/".join(p for p in parts if p not in ("", ".", "/"))] = member

    def _member(self, name: str) -> tarfile.TarInfo | None:
        path = _inner_path(name, self.description)
        for _hop in range(16):  # `docker save` links repeated layers to the first copy
            member = self.members.get(path)
            if member is None or not member.issym():
                return member
            path = _resolve_inside(PurePosixPath(path).parent, member.linkname, self.description)
        raise InvalidArgument(f"{self.description}: too many symlinks resolving {name}")

    def exists(self, name: str) -> bool:
        member = self._member(name)
        return member is not None and (member.isreg() or member.islnk())

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        member = self._member(name)
        stream = self.archive.extractfile(member) if member is not None else None
        if stream is None:
            raise InvalidArgument(f"{self.description}: {name} is missing or not a file")
        with stream:
            yield stream


def _read_json_bytes(source: _Source, name: str) -> bytes:
    with source.open(name) as stream:
        data = stream.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise InvalidArgument(f"{source.description}: {name} is larger than {_MAX_JSON} bytes")
    return data


def _blob_name(digest: str) -> str:
    algorithm, _, hex_part = digest.partition(":")
    return f"blobs/{algorithm}/{hex_part}"


def _read_blob(source: _Source, descriptor: Descriptor, what: str) -> bytes:
    data = _read_json_bytes(source, _blob_name(descriptor.digest))
    algorithm, _, expected = descriptor.digest.partition(":")
    if hashlib.new(algorithm, data).hexdigest() != expected:
        raise InvalidArgument(
            f"{source.description}: {what} {descriptor.digest} does not match its digest"
        )
    return data


@dataclass
class _Candidate:
    """One image to import and the names it gets."""

    manifest: Descriptor
    tags: list[str] = field(default_factory=list)


def import_image(store: ImageStore, path: Path, name: str | None = None) -> list[ImageRecord]:
    """Import every image in the layout or archive at `path` (for an index of several
    platforms, the host's). `name` tags the image(s), overriding names in the file."""
    if name is not None:
        _check_name(name)
    if path.is_dir():
        return _import_from(store, _DirSource(path), name)
    if not path.exists():
        raise InvalidArgument(f"{path} does not exist")
    try:
        # Bounded headers and sparse maps, as for layers; the member index this random
        # access keeps is bounded by the entry limit below.
        archive = tarfile.open(path, "r:*", tarinfo=BoundedTarInfo)
    except (tarfile.TarError, OSError) as exc:
        raise InvalidArgument(
            f"{path} is neither an OCI layout directory nor a tar archive: {exc}"
        ) from exc
    with archive:
        return _import_from(store, _TarSource(archive, str(path)), name)


def _check_name(name: str) -> None:
    parsed = parse_named(name)
    if parsed.digest is not None:
        raise InvalidArgument(f"--name {name!r}: give a tag, not a digest")


def _import_from(store: ImageStore, source: _Source, name: str | None) -> list[ImageRecord]:
    if source.exists("index.json") and (
        source.exists("oci-layout") or not source.exists("manifest.json")
    ):
        return _import_oci(store, source, name)
    if source.exists("manifest.json"):
        return _import_docker(store, source, name)
    raise InvalidArgument(
        f"{source.description}: not an image: no index.json (OCI layout) "
        "and no manifest.json (docker-archive)"
    )


# --- OCI layout --------------------------------------------------------------------------
def _import_oci(store: ImageStore, source: _Source, name: str | None) -> list[ImageRecord]:
    if source.exists("oci-layout"):
        layout = json.loads(_read_json_bytes(source, "oci-layout") or b"{}")
        version = str(layout.get("imageLayoutVersion", ""))
        if not version.startswith("1."):
            raise InvalidArgument(
                f"{source.description}: unsupported OCI layout version {version!r}"
            )
    wanted = host_platform()
    entries = parse_index(_read_json_bytes(source, "index.json"), "index.json")
    candidates: dict[str, _Candidate] = {}
    skipped: list[str] = []
    for entry in entries:
        if is_attestation(entry) or not platform_matches(entry.platform, wanted):
            skipped.append(str(entry.platform or entry.media_type))
            continue
        target = _manifest_for(source, entry)
        if target is None:
            skipped.append(entry.media_type)
            continue
        candidate = candidates.setdefault(target.digest, _Candidate(target))
        candidate.tags.extend(t for t in _oci_tags(entry, name) if t not in candidate.tags)
    if not candidates:
        raise InvalidArgument(
            f"{source.description}: no image for platform {wanted} "
            f"(entries: {', '.join(skipped) or 'none'})"
        )
    records = []
    for candidate in candidates.values():
        manifest_bytes = _read_blob(source, candidate.manifest, "manifest")
        manifest = parse_manifest(manifest_bytes, f"manifest {candidate.manifest.digest}")
        config_bytes = _read_blob(source, manifest.config, "image config")
        layers = _copy_layers(
            store,
            source,
            config_bytes,
            [
                (layer.digest, layer.media_type, _blob_name(layer.digest))
                for layer in manifest.layers
            ],
            sizes=[layer.size for layer in manifest.layers],
        )
        repo_digests = [
            f"{parse_reference(tag).name}@{candidate.manifest.digest}" for tag in candidate.tags
        ]
        records.append(
            store.add_image(
                config_bytes,
                layers,
                manifest_digest=candidate.manifest.digest,
                repo_tags=candidate.tags,
                repo_digests=repo_digests,
                manifest_bytes=manifest_bytes,
            )
        )
    return records


def _manifest_for(source: _Source, entry: Descriptor) -> Descriptor | None:
    """The image manifest an index.json entry stands for: itself, or for a nested index
    (a multi-platform image) the host platform's entry, with the outer annotations."""
    media_type = entry.media_type
    if not media_type:
        media_type = media_type_of(_read_blob(source, entry, "index entry"), entry.digest)
    if media_type in MANIFEST_TYPES:
        return entry
    if media_type not in INDEX_TYPES:
        return None  # an artifact (signature, SBOM...) rather than an image
    nested = parse_index(_read_blob(source, entry, "image index"), f"image index {entry.digest}")
    chosen = select_platform(nested, host_platform(), f"image index {entry.digest}")
    return Descriptor(
        media_type=chosen.media_type or media_type,
        digest=chosen.digest,
        size=chosen.size,
        annotations=entry.annotations,
        platform=chosen.platform,
    )


def _oci_tags(entry: Descriptor, name: str | None) -> list[str]:
    ref_name = entry.annotations.get(REF_NAME_ANNOTATION, "")
    full_name = entry.annotations.get(CONTAINERD_NAME_ANNOTATION, "")
    if not full_name and any(c in ref_name for c in "/:@"):
        full_name = ref_name  # skopeo `oci:dir:docker.io/x:y` writes the whole reference
    bare_tag = ref_name if ref_name and ref_name != full_name else ""
    if name is not None:
        # --name without a tag names the repository; the file's tag, if any, is kept.
        parsed = parse_named(name)
        file_tag = bare_tag or (parse_named(full_name).tag if full_name else None)
        if parsed.tag is None and file_tag:
            return [parsed.with_tag(file_tag).string()]
        return [parse_reference(name).string()]
    if full_name:
        return [parse_reference(full_name).string()]
    if bare_tag:
        log.warning(
            "image %s is named only %r (a tag without a repository); it is imported "
            "untagged: give --name to tag it",
            entry.digest,
            bare_tag,
        )
    return []


# --- docker-archive ----------------------------------------------------------------------
def _import_docker(store: ImageStore, source: _Source, name: str | None) -> list[ImageRecord]:
    try:
        entries = json.loads(_read_json_bytes(source, "manifest.json"))
    except ValueError as exc:
        raise InvalidArgument(f"{source.description}: manifest.json is not JSON: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise InvalidArgument(f"{source.description}: manifest.json lists no images")
    records = []
    for number, entry in enumerate(entries):
        what = f"{source.description}: manifest.json entry {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str):
            raise InvalidArgument(f"{what} has no Config")
        layer_paths = entry.get("Layers")
        if not isinstance(layer_paths, list) or not all(isinstance(p, str) for p in layer_paths):
            raise InvalidArgument(f"{what} has no Layers list")
        config_bytes = _read_json_bytes(source, entry["Config"])
        layers = _copy_layers(
            store, source, config_bytes, [(None, None, path) for path in layer_paths]
        )
        if name is not None:
            tags = [parse_reference(name).string()]
        else:
            tags = [parse_reference(t).string() for t in entry.get("RepoTags") or []]
        records.append(store.add_image(config_bytes, layers, repo_tags=tags))
    return records


# --- layers ------------------------------------------------------------------------------
def _copy_layers(
    store: ImageStore,
    source: _Source,
    config_bytes: bytes,
    layers: list[tuple[str | None, str | None, str]],
    sizes: list[int] | None = None,
) -> list[LayerBlob]:
    """Put each layer blob that is not already unpacked into the store; returns the
    blobs for `add_image`. `layers` holds (digest or None, media type or None, path)."""
    try:
        diff_ids = json.loads(config_bytes)["rootfs"]["diff_ids"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{source.description}: image config has no rootfs.diff_ids") from exc
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise InvalidArgument(
            f"{source.description}: the image config lists {len(diff_ids)} layers "
            f"but the manifest has {len(layers)}"
        )
    blobs = []
    for index, (chain, diff_id, (digest, media_type, path)) in enumerate(
        zip(chain_ids(diff_ids), diff_ids, layers, strict=True)
    ):
        if store.has_layer(chain):
            # Already unpacked: add_image will not need the blob, so it is not copied.
            blobs.append(LayerBlob(digest or diff_id, media_type or DOCKER_LAYER))
            continue
        with source.open(path) as stream:
            size = sizes[index] if sizes is not None and sizes[index] >= 0 else None
            if digest is None:
                head = stream.read(6)
                compression = sniff_compression(head)
                media_type = DOCKER_LAYER if compression == "none" else DOCKER_LAYER_GZIP
                digest = store.put_blob(_prepend(head, stream))
            else:
                digest = store.put_blob(stream, digest, size)
        blobs.append(LayerBlob(digest, media_type or DOCKER_LAYER))
    return blobs


def _prepend(head: bytes, stream: IO[bytes]) -> Iterator[bytes]:
    yield head
    while chunk := stream.read(1 << 20):
        yield chunk


# --- command line ------------------------------------------------------------------------
def main_import(argv: list[str]) -> int:
    """`cri-shim images import [--config CONFIG] PATH [--name REF]`; argv excludes the
    `images import` words. Safe while the daemon runs: it only adds rows and files."""
    from cri_shim.config import ConfigError, load_config
    from cri_shim.state.db import Database

    parser = argparse.ArgumentParser(
        prog="cri-shim images import",
        description="Import an image from an OCI layout directory, an OCI archive or a "
        "docker-archive tar into the local image store.",
    )
    parser.add_argument("--config", type=Path, default=None, help="daemon configuration file")
    parser.add_argument("--name", help="tag the image(s) with this reference")
    parser.add_argument("path", type=Path, help="OCI layout directory or archive")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="cri-shim images import: %(message)s")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"cri-shim images import: {exc}", file=sys.stderr)
        return 2
    db = Database(cfg.state_db)
    try:
        store = ImageStore(cfg.root, db, unpack_policy=UnpackPolicy.from_config(cfg.images))
        records = import_image(store, args.path, args.name)
    except CriError as exc:
        print(f"cri-shim images import: {exc}", file=sys.stderr)
        return 1
    finally:
        db.close()
    for record in records:
        print(record.id, *(record.repo_tags or ["<untagged>"]))
    return 0


if __name__ == "__main__":
    sys.exit(main_import(sys.argv[1:]))
