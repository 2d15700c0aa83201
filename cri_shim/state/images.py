"""The image catalog's and the layer store's rows: `images` (config, layers and the names
each image answers to) and `layers` (one unpacked directory per chain ID)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator

from cri_shim.state.db import Database
from cri_shim.state.records import ImageRecord, image_from_row

# The JSON list columns a name can be looked up in.
_NAME_COLUMNS = ("repo_tags", "repo_digests")


class ImageRows:
    def __init__(self, db: Database) -> None:
        self.db = db

    def save(self, record: ImageRecord) -> None:
        self.db.execute(
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

    def set_names(self, image_id: str, tags: list[str], digests: list[str]) -> None:
        self.db.execute(
            "UPDATE images SET repo_tags = ?, repo_digests = ? WHERE id = ?",
            (json.dumps(tags), json.dumps(digests), image_id),
        )

    def delete(self, image_id: str) -> None:
        self.db.execute("DELETE FROM images WHERE id = ?", (image_id,))

    def others_named(self, image_id: str, names: Collection[str]) -> list[ImageRecord]:
        """The images other than `image_id` holding any of `names` as a tag or digest."""
        if not names:
            return []
        marks = ",".join("?" * len(names))
        rows = self.db.query(
            "SELECT DISTINCT images.* FROM images, json_each(images.repo_tags) AS t "
            f"WHERE t.value IN ({marks}) AND images.id != ? "
            "UNION SELECT DISTINCT images.* FROM images, json_each(images.repo_digests) AS d "
            f"WHERE d.value IN ({marks}) AND images.id != ?",
            (*names, image_id, *names, image_id),
        )
        return [image_from_row(row) for row in rows]

    def by_id(self, image_id: str) -> ImageRecord | None:
        row = self.db.query_one("SELECT * FROM images WHERE id = ?", (image_id,))
        return image_from_row(row) if row is not None else None

    def by_name(self, column: str, value: str) -> ImageRecord | None:
        """The image whose `column` (repo_tags or repo_digests) lists `value`."""
        if column not in _NAME_COLUMNS:
            raise ValueError(f"not a name column: {column}")
        row = self.db.query_one(
            f"SELECT images.* FROM images, json_each(images.{column}) AS r WHERE r.value = ?",
            (value,),
        )
        return image_from_row(row) if row is not None else None

    def by_id_prefix(self, hex_prefix: str, limit: int = 2) -> list[ImageRecord]:
        """Up to `limit` images whose ID starts with `sha256:<hex_prefix>`."""
        rows = self.db.query(
            "SELECT * FROM images WHERE id >= ? AND id < ? LIMIT ?",
            # 'g' sorts after every hex digit
            (f"sha256:{hex_prefix}", f"sha256:{hex_prefix}g", limit),
        )
        return [image_from_row(row) for row in rows]

    def all(self) -> list[ImageRecord]:
        """Every image, oldest first."""
        rows = self.db.query("SELECT * FROM images ORDER BY created_at, id")
        return [image_from_row(row) for row in rows]

    def layer_lists(self) -> Iterator[list[str]]:
        """Each image's chain IDs."""
        for row in self.db.query("SELECT layers FROM images"):
            yield list(json.loads(row["layers"]))


class LayerRows:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(
        self, chain_id: str, diff_id: str, parent: str | None, path: str, size: int, now: int
    ) -> None:
        self.db.execute(
            "INSERT INTO layers (chain_id, diff_id, parent, path, size, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (chain_id, diff_id, parent, path, size, now),
        )

    def sizes(self, chains: Collection[str]) -> dict[str, int]:
        """The recorded size of each of `chains` that has a row."""
        if not chains:
            return {}
        marks = ",".join("?" * len(chains))
        rows = self.db.query(
            f"SELECT chain_id, size FROM layers WHERE chain_id IN ({marks})", tuple(chains)
        )
        return {str(row["chain_id"]): int(row["size"]) for row in rows}

    def chain_ids(self) -> list[str]:
        return [str(row["chain_id"]) for row in self.db.query("SELECT chain_id FROM layers")]

    def delete(self, chain_id: str) -> None:
        self.db.execute("DELETE FROM layers WHERE chain_id = ?", (chain_id,))
