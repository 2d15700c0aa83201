"""Images: the records in the `images` table and the names that find them.

A record holds an image's config, its layers (chain IDs) and the names it answers to:
tags (`docker.io/library/busybox:latest`) and repo digests (`name@sha256:…`), each held
by one image at a time. `get` finds a record by any name, by ID or by a unique ID prefix,
as crictl and kubelet pass them.
"""

from __future__ import annotations

import builtins
import json
import re
from typing import Any

from cri_shim.errors import InvalidArgument, NotFound
from cri_shim.images.reference import (
    DIGEST_HEX_LENGTHS,
    Reference,
    parse_named,
    parse_reference,
    validate_digest,
)
from cri_shim.state.db import Database
from cri_shim.state.images import ImageRows
from cri_shim.state.records import ImageRecord

_ID_PREFIX = re.compile(r"(?:sha256:)?([a-f0-9]{3,64})")


def parse_config(config_bytes: bytes) -> dict[str, Any]:
    """An image config as JSON, refused unless it lists its layers' diff IDs."""
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


def tag_string(ref: str) -> str:
    """`ref` as the tag it names, normalised; a digest reference is refused."""
    parsed = parse_reference(ref)
    if parsed.digest is not None:
        raise InvalidArgument(f"{ref!r} is a digest reference, not a tag")
    return parsed.string()


def repo_digest_string(ref: str) -> str:
    """`ref` as the repo digest (`name@sha256:…`) it names, normalised."""
    parsed = parse_named(ref)
    if parsed.digest is None:
        raise InvalidArgument(f"repo digest {ref!r} has no @digest")
    return f"{parsed.name}@{parsed.digest}"


class ImageCatalog:
    """The `images` table. The writers (`put`, `tag`, `delete`) run inside a transaction
    of their own or the caller's; the image store calls them under its lock."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.rows = ImageRows(db)

    # --- writing -----------------------------------------------------------------------
    def put(
        self,
        image_id: str,
        config: dict[str, Any],
        chains: builtins.list[str],
        size: int,
        manifest_digest: str,
        tags: builtins.list[str],
        digests: builtins.list[str],
        now: int,
    ) -> ImageRecord:
        """Inside a transaction: write the image, merging the names of an existing record
        of the same ID, and take its tags and digests from any other image."""
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
            size=size,
            config=config,
            layers=chains,
            created_at=created_at,
            manifest_digest=manifest_digest,
        )
        self._take_references(image_id, tags, digests)
        self.rows.save(record)
        return record

    def _take_references(
        self, image_id: str, tags: builtins.list[str], digests: builtins.list[str]
    ) -> None:
        """Strip `tags` and `digests` from every other image (inside a transaction): a tag
        names one image at a time, and the newest assignment wins, as with docker."""
        wanted = set(tags) | set(digests)
        for other in self.rows.others_named(image_id, wanted):
            self.rows.set_names(
                other.id,
                [t for t in other.repo_tags if t not in wanted],
                [d for d in other.repo_digests if d not in wanted],
            )

    def tag(self, image_id: str, ref: str) -> ImageRecord:
        """Point the tag `ref` at the image `image_id` (any form `resolve` takes), taking
        it from whichever image had it."""
        tag = tag_string(ref)
        with self.db.transaction():
            record = self.resolve(image_id)
            if tag in record.repo_tags:
                return record
            self._take_references(record.id, [tag], [])
            record.repo_tags.append(tag)
            self.rows.set_names(record.id, record.repo_tags, record.repo_digests)
        return record

    def delete(self, ref: str) -> ImageRecord | None:
        """Delete the image `ref` names, with all its names; None when there is none."""
        with self.db.transaction():
            record = self.get(ref)
            if record is None:
                return None
            self.rows.delete(record.id)
        return record

    def referenced_layers(self) -> set[str]:
        """The chain IDs some image uses."""
        referenced: set[str] = set()
        for layers in self.rows.layer_lists():
            referenced.update(layers)
        return referenced

    # --- lookups -----------------------------------------------------------------------
    def _get_by_id(self, image_id: str) -> ImageRecord | None:
        return self.rows.by_id(image_id)

    def _find_by(self, column: str, value: str) -> ImageRecord | None:
        return self.rows.by_name(column, value)

    def _find_by_id_prefix(self, prefix: str, ref: str) -> ImageRecord | None:
        found = self.rows.by_id_prefix(prefix)
        if len(found) > 1:
            raise InvalidArgument(f"image ID prefix {ref!r} is ambiguous: use more digits")
        return found[0] if found else None

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

    def list(self, filter_ref: str | None = None) -> builtins.list[ImageRecord]:
        """All images, oldest first; or those `filter_ref` names. A filter without a tag
        (`busybox`) matches every tag and digest of that repository, as `crictl images
        busybox` expects; with a tag, digest or ID it matches one image."""
        if not filter_ref:
            return self.rows.all()
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


def _union(first: list[str], second: list[str]) -> list[str]:
    return list(dict.fromkeys([*first, *second]))
