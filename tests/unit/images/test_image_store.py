"""The image store: content addressing, shared layers, tags, lookups, removal and GC.

Images here are tiny synthetic ones (files owned by the test's own user), so that these
tests run without root; the busybox image is exercised in the importer and overlay tests.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import os
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from cri_shim.errors import FailedPrecondition, Internal, InvalidArgument, NotFound
from cri_shim.images.content import DigestMismatch
from cri_shim.images.layers import LayerBlob, chain_ids
from cri_shim.images.store import ImageStore
from cri_shim.state.db import Database


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Layer:
    blob: bytes
    diff_id: str

    @property
    def digest(self) -> str:
        return sha(self.blob)


def make_layer(files: dict[str, bytes]) -> Layer:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1
            info.uid, info.gid = os.getuid(), os.getgid()
            tar.addfile(info, io.BytesIO(data))
    plain = buffer.getvalue()
    return Layer(gzip.compress(plain, mtime=0), sha(plain))


_unique = itertools.count()


def make_config(layers: list[Layer], **runtime: object) -> bytes:
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": runtime or {"Cmd": ["sh"], "Labels": {"n": str(next(_unique))}},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }
    return json.dumps(config).encode()


BASE = make_layer({"base": b"base layer"})
MIDDLE = make_layer({"middle": b"middle layer"})
TOP_A = make_layer({"a": b"image a"})
TOP_B = make_layer({"b": b"image b"})


def add(store: ImageStore, layers: list[Layer], tags: list[str] = (), **kw: object):  # type: ignore[assignment,no-untyped-def]
    for layer in layers:
        if not store.has_blob(layer.digest):
            store.put_blob(layer.blob, layer.digest)
    config = kw.pop("config", None) or make_config(layers)
    return store.add_image(
        config,  # type: ignore[arg-type]
        [LayerBlob(layer.digest) for layer in layers],
        repo_tags=tags,
        **kw,  # type: ignore[arg-type]
    )


# --- blobs -------------------------------------------------------------------------------
def test_put_blob_is_content_addressed(store: ImageStore) -> None:
    data = b"some blob"
    digest = store.put_blob(data)
    assert digest == sha(data)
    path = store.root / "images/blobs/sha256" / digest.removeprefix("sha256:")
    assert path.read_bytes() == data
    assert store.put_blob(io.BytesIO(data), digest) == digest
    assert store.put_blob(iter([b"some ", b"blob"]), None) == digest
    assert store.read_blob(digest) == data


def test_put_blob_refuses_content_that_does_not_match(store: ImageStore) -> None:
    wrong = sha(b"something else")
    with pytest.raises(DigestMismatch, match="hashes to"):
        store.put_blob(b"content", wrong)
    assert not store.has_blob(wrong)
    assert not store.has_blob(sha(b"content"))
    assert list(store.tmp_dir.iterdir()) == []  # no half-written blob left anywhere
    with pytest.raises(DigestMismatch, match="announced"):
        store.put_blob(b"content", sha(b"content"), expected_size=3)
    with pytest.raises(InvalidArgument):
        store.put_blob(b"content", "sha256:short")


# --- adding ------------------------------------------------------------------------------
def test_add_image_records_and_unpacks(store: ImageStore) -> None:
    config = make_config([BASE, TOP_A], Cmd=["run"], User="1000")
    image = add(store, [BASE, TOP_A], ["busybox"], config=config)
    assert image.id == sha(config)
    assert image.repo_tags == ["docker.io/library/busybox:latest"]
    # Chain IDs per the OCI image spec.
    top_chain = sha(f"{BASE.diff_id} {TOP_A.diff_id}".encode())
    assert image.layers == [BASE.diff_id, top_chain] == chain_ids([BASE.diff_id, TOP_A.diff_id])
    assert (store.layers_dir / top_chain.removeprefix("sha256:") / "diff/a").read_bytes() == (
        b"image a"
    )
    assert image.size == len(b"base layer") + len(b"image a")
    assert image.created_at > 0
    assert image.cmd == ["run"] and image.user == "1000"
    # The compressed blobs go once unpacked; the config stays.
    assert not store.has_blob(BASE.digest)
    assert store.has_blob(image.id)
    assert store.resolve("busybox") == image


def test_layer_blobs_kept_when_asked(tmp_path: Path, db: Database) -> None:
    store = ImageStore(tmp_path / "keep", db, keep_layer_blobs=True)
    add(store, [BASE])
    assert store.has_blob(BASE.digest)


def test_shared_layers_are_unpacked_once(store: ImageStore) -> None:
    a = add(store, [BASE, MIDDLE, TOP_A], ["a"])
    base_dir = store.layer_path(a.layers[0]) / "diff"
    inode = base_dir.stat().st_ino
    # The second image's shared layers need no blob at all: they are already unpacked.
    store.put_blob(TOP_B.blob, TOP_B.digest)
    b = store.add_image(
        make_config([BASE, MIDDLE, TOP_B]),
        [LayerBlob("sha256:" + "0" * 64), LayerBlob("sha256:" + "1" * 64), LayerBlob(TOP_B.digest)],
        repo_tags=["b"],
    )
    assert a.layers[:2] == b.layers[:2] and a.layers[2] != b.layers[2]
    assert base_dir.stat().st_ino == inode
    assert len([p for p in store.layers_dir.iterdir()]) == 4
    assert len(store.db.query("SELECT * FROM layers")) == 4


def test_same_diff_at_another_position_is_another_layer(store: ImageStore) -> None:
    a = add(store, [BASE, TOP_A])
    b = add(store, [TOP_A])
    assert a.layers[1] != b.layers[0]
    assert (store.layer_path(b.layers[0]) / "diff/a").exists()


def test_diff_id_mismatch_is_refused_and_leaves_nothing(store: ImageStore) -> None:
    store.put_blob(TOP_A.blob, TOP_A.digest)
    config = make_config([TOP_B])  # says the layer is TOP_B's content
    with pytest.raises(DigestMismatch, match="diff ID"):
        store.add_image(config, [LayerBlob(TOP_A.digest)], repo_tags=["x"])
    assert store.list() == []
    assert [p.name for p in store.layers_dir.iterdir()] == []


def test_missing_blob_fails_clearly(store: ImageStore) -> None:
    with pytest.raises(FailedPrecondition, match="not in the image store"):
        store.add_image(make_config([BASE]), [LayerBlob(BASE.digest)])


def test_layer_count_must_match_config(store: ImageStore) -> None:
    with pytest.raises(InvalidArgument, match="lists 2 layers"):
        store.add_image(make_config([BASE, TOP_A]), [LayerBlob(BASE.digest)])
    with pytest.raises(InvalidArgument, match="rootfs"):
        store.add_image(b'{"config": {}}', [])
    with pytest.raises(InvalidArgument, match="JSON"):
        store.add_image(b"not json", [])


def test_adding_again_merges_tags_and_keeps_creation_time(store: ImageStore) -> None:
    config = make_config([BASE])
    first = add(store, [BASE], ["one"], config=config)
    again = add(store, [BASE], ["two"], config=config)
    assert again.id == first.id
    assert again.repo_tags == ["docker.io/library/one:latest", "docker.io/library/two:latest"]
    assert again.created_at == first.created_at
    assert len(store.list()) == 1


# --- tags and lookups --------------------------------------------------------------------
def test_a_tag_moves_to_the_newest_image(store: ImageStore) -> None:
    old = add(store, [BASE], ["app:1", "app:stable"])
    new = add(store, [BASE, TOP_A], ["app:1"])
    assert store.resolve("app:1").id == new.id
    assert store.resolve(old.id).repo_tags == ["docker.io/library/app:stable"]
    store.tag(old.id, "app:1")
    assert store.resolve("app:1").id == old.id
    assert store.resolve(new.id).repo_tags == []
    # An untagged image stays, reachable by ID, as docker keeps a dangling image.
    assert {i.id for i in store.list()} == {old.id, new.id}


def test_tag_refuses_digests_and_unknown_images(store: ImageStore) -> None:
    image = add(store, [BASE])
    with pytest.raises(InvalidArgument, match="digest"):
        store.tag(image.id, "app@sha256:" + "a" * 64)
    with pytest.raises(NotFound):
        store.tag("sha256:" + "f" * 64, "app:1")


def test_resolve_by_every_kind_of_reference(store: ImageStore) -> None:
    manifest = sha(b"manifest")
    image = add(
        store,
        [BASE],
        ["quay.io/org/app:v1"],
        manifest_digest=manifest,
        repo_digests=[f"quay.io/org/app@{manifest}"],
    )
    hex_id = image.id.removeprefix("sha256:")
    for ref in (
        "quay.io/org/app:v1",
        f"quay.io/org/app@{manifest}",
        f"quay.io/org/app:v1@{manifest}",  # the digest decides
        f"quay.io/org/app:other@{manifest}",
        image.id,
        hex_id,
        hex_id[:3],
        hex_id[:12],
        f"sha256:{hex_id[:5]}",
    ):
        assert store.resolve(ref).id == image.id, ref
    for ref in ("quay.io/org/app", "quay.io/org/app:v2", f"docker.io/org/app@{manifest}"):
        assert store.get(ref) is None, ref
        with pytest.raises(NotFound, match="not found"):
            store.resolve(ref)


def test_names_win_over_id_prefixes(store: ImageStore) -> None:
    image = add(store, [BASE])
    prefix = image.id.removeprefix("sha256:")[:4]
    named = add(store, [TOP_A], [prefix])  # an image *called* like the other's ID prefix
    assert store.resolve(prefix).id == named.id
    assert store.resolve(f"sha256:{prefix}").id == image.id


def test_ambiguous_id_prefix_is_refused(store: ImageStore) -> None:
    seen: dict[str, str] = {}
    for n in range(5000):  # configs of empty images until two IDs share 3 hex digits
        config = json.dumps({"config": {"Labels": {"n": str(n)}}, "rootfs": {"diff_ids": []}})
        prefix = sha(config.encode())[7:10]
        if prefix in seen:
            store.add_image(seen[prefix].encode(), [])
            store.add_image(config.encode(), [])
            break
        seen[prefix] = config
    with pytest.raises(InvalidArgument, match="ambiguous"):
        store.resolve(prefix)


def test_short_or_invalid_references(store: ImageStore) -> None:
    add(store, [BASE], ["abc"])
    assert store.get("ab") is None  # too short for an ID prefix, and no such name
    with pytest.raises(InvalidArgument):
        store.get("Not Valid")
    with pytest.raises(InvalidArgument):
        store.get("sha256:xyz")


def test_list_and_filters(store: ImageStore) -> None:
    a = add(store, [BASE], ["app:1"])
    b = add(store, [TOP_A], ["app:2", "other:1"])
    c = add(store, [TOP_B], ["other:2"])
    assert [i.id for i in store.list()] == [a.id, b.id, c.id]
    assert [i.id for i in store.list("app")] == [a.id, b.id]  # every tag of the repository
    assert [i.id for i in store.list("app:2")] == [b.id]
    assert [i.id for i in store.list(c.id)] == [c.id]
    assert store.list("nothing") == []
    assert store.list("Not Valid") == []


# --- removal and garbage collection -----------------------------------------------------
def test_remove_drops_all_tags_and_unshared_layers(store: ImageStore) -> None:
    a = add(store, [BASE, TOP_A], ["a:1", "a:2"], manifest_bytes=b"{}", manifest_digest=sha(b"{}"))
    b = add(store, [BASE, TOP_B], ["b"])
    removed = store.remove("a:2")
    assert removed is not None and removed.id == a.id
    assert store.get("a:1") is None and store.get(a.id) is None
    assert not store.has_blob(a.id) and not store.has_blob(sha(b"{}"))
    # The base is still b's; a's top layer is gone, row and directory.
    assert store.has_layer(BASE.diff_id)
    assert not store.has_layer(a.layers[1])
    assert store.db.query_one("SELECT 1 FROM layers WHERE chain_id = ?", (a.layers[1],)) is None
    store.remove(b.id)
    assert list(store.layers_dir.iterdir()) == []
    assert store.db.query("SELECT * FROM layers") == []


def test_remove_unknown_is_not_an_error(store: ImageStore) -> None:
    assert store.remove("never-pulled") is None
    assert store.remove("sha256:" + "e" * 64) is None


def test_layers_in_use_survive_until_gc_says_otherwise(store: ImageStore) -> None:
    image = add(store, [BASE, TOP_A], ["a"])
    busy = {image.layers[1]}
    asked: list[set[str]] = []

    def in_use(candidates):  # type: ignore[no-untyped-def]
        asked.append(set(candidates))
        return busy & set(candidates)

    store.remove("a", in_use=in_use)
    assert asked == [set(image.layers)]
    assert store.has_layer(image.layers[1]) and not store.has_layer(image.layers[0])
    assert store.gc_layers(in_use) == []
    busy.clear()
    assert store.gc_layers(in_use) == [image.layers[1]]
    assert list(store.layers_dir.iterdir()) == []


def test_store_wide_in_use_hook(tmp_path: Path, db: Database) -> None:
    store = ImageStore(tmp_path / "hooked", db, in_use=lambda chains: set(chains))
    image = add(store, [BASE], ["a"])
    store.remove("a")
    assert store.has_layer(image.layers[0])


def test_lower_dirs_top_first(store: ImageStore) -> None:
    image = add(store, [BASE, MIDDLE, TOP_A])
    dirs = store.lower_dirs(image)
    assert [d.parent.name for d in dirs] == [c.removeprefix("sha256:") for c in image.layers[::-1]]
    assert (dirs[0] / "a").exists() and (dirs[-1] / "base").exists()
    assert store.lower_dirs(image.id) == dirs
    assert [ImageStore.chain_id_of_lower_dir(d) for d in dirs] == image.layers[::-1]
    (dirs[1] / "middle").unlink()
    dirs[1].rmdir()
    with pytest.raises(FailedPrecondition, match="missing"):
        store.lower_dirs(image)


def test_a_vanished_layer_directory_is_unpacked_again(store: ImageStore) -> None:
    image = add(store, [BASE], ["a"])
    diff = store.layer_path(image.layers[0]) / "diff"
    (diff / "base").unlink()
    diff.rmdir()
    add(store, [BASE], ["a"], config=json.dumps(image.config).encode())
    assert (diff / "base").exists()


def test_fs_info_counts_what_the_store_uses(store: ImageStore) -> None:
    mountpoint, used_before, inodes_before = store.fs_info()
    assert mountpoint == store.root / "images"
    add(store, [BASE, make_layer({"big": b"x" * 200_000})])
    info = store.fs_info()
    assert info.used_bytes >= used_before + 200_000
    assert info.inodes_used >= inodes_before + 2


def test_crash_leftovers_are_removed_on_open(tmp_path: Path, db: Database) -> None:
    store = ImageStore(tmp_path / "r", db)
    dead = store.layers_dir / ".tmp-999999999-abc"  # no such pid
    live = store.layers_dir / f".tmp-{os.getpid()}-abc"
    trash = store.layers_dir / ".trash-deadbeef-1"
    partial_blob = store.tmp_dir / ".tmp-999999999-def"
    for d in (dead, live, trash):
        (d / "diff").mkdir(parents=True)
    partial_blob.write_bytes(b"half")
    ImageStore(tmp_path / "r", db)
    assert not dead.exists() and not trash.exists() and not partial_blob.exists()
    assert live.exists()


def test_image_record_config_helpers(store: ImageStore) -> None:
    config = make_config(
        [BASE],
        Env=["PATH=/bin", "A=1"],
        Entrypoint=["/init"],
        Cmd=["serve"],
        User="app:app",
        WorkingDir="/srv",
        StopSignal="SIGQUIT",
        Volumes={"/data": {}, "/cache": {}},
        ExposedPorts={"80/tcp": {}},
        Labels={"k": "v"},
    )
    image = add(store, [BASE], config=config)
    assert image.env == ["PATH=/bin", "A=1"]
    assert image.entrypoint == ["/init"] and image.cmd == ["serve"]
    assert image.user == "app:app" and image.working_dir == "/srv"
    assert image.stop_signal == "SIGQUIT"
    assert image.volumes == ["/cache", "/data"]
    assert sorted(image.config["config"]["ExposedPorts"]) == ["80/tcp"]
    assert image.labels == {"k": "v"}
    assert image.diff_ids == [BASE.diff_id]


def test_concurrent_adds_of_images_sharing_layers(tmp_path: Path) -> None:
    """Two writers (separate connections, as the daemon and `images import` are) add
    images sharing layers at the same time: both succeed, each layer exists once."""
    root = tmp_path / "root"
    errors: list[BaseException] = []
    tops = [make_layer({f"top{n}": str(n).encode()}) for n in range(6)]

    def writer(n: int) -> None:
        database = Database(tmp_path / "state.db")
        try:
            store = ImageStore(root, database)
            add(store, [BASE, MIDDLE, tops[n]], [f"img:{n}"])
        except BaseException as exc:
            errors.append(exc)
        finally:
            database.close()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    database = Database(tmp_path / "state.db")
    store = ImageStore(root, database)
    assert len(store.list()) == 6
    names = [p.name for p in store.layers_dir.iterdir()]
    assert len(names) == 2 + 6 and not [n for n in names if n.startswith(".")]
    database.close()


def test_visible_to_another_connection_at_once(tmp_path: Path, store: ImageStore) -> None:
    other = Database(store.db.path)
    reader = ImageStore(store.root, other)
    assert reader.get("a") is None
    add(store, [BASE], ["a"])
    assert reader.resolve("a").layers == [BASE.diff_id]
    other.close()


def test_a_failed_unpack_leaves_no_directory(
    store: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("../escape"), io.BytesIO(b""))
    evil_layer = Layer(evil.getvalue(), sha(evil.getvalue()))
    with pytest.raises(InvalidArgument, match=r"layer sha256:.*'\.\.'"):
        add(store, [evil_layer])
    assert list(store.layers_dir.iterdir()) == []

    def disk_full(blob: object, dest: Path, policy: object = None) -> None:
        (dest / "partial").mkdir(parents=True)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cri_shim.images.unpack.unpack_layer", disk_full)
    with pytest.raises(Internal, match="No space left"):
        add(store, [BASE])
    assert list(store.layers_dir.iterdir()) == []
    assert store.list() == []
