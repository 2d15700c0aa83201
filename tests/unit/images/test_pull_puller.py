"""The puller against an in-memory registry: platform choice, mirrors, shared downloads,
verification, names. The real registry and daemon are in tests/integration/images."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from cri_shim.errors import NotFound, Unauthenticated, Unavailable
from cri_shim.images.auth import Credentials
from cri_shim.images.manifest import Platform, host_platform
from cri_shim.images.pull import HostTrustOnFirstUse, ImagePuller
from cri_shim.images.registry import ContentMismatch
from cri_shim.images.store import ImageStore
from tests.imagebuild import build_image
from tests.registry import DOCKER_LIST, FakeRegistry, fake_transport
from tests.waiting import until

HOST = host_platform()
OTHER = Platform("linux", "s390x") if HOST.architecture != "s390x" else Platform("linux", "ppc64le")


def platform_dict(platform: Platform) -> dict[str, str]:
    result = {"os": platform.os, "architecture": platform.architecture}
    if platform.variant:
        result["variant"] = platform.variant
    return result


@pytest.fixture
def registry() -> FakeRegistry:
    return FakeRegistry("reg.test")


@pytest.fixture
async def puller(store: ImageStore, registry: FakeRegistry) -> AsyncIterator[ImagePuller]:
    p = ImagePuller(store, transport=fake_transport(registry))
    yield p
    await p.aclose()


def blob_files(store: ImageStore) -> list[str]:
    return sorted(p.name for p in store.blob_dir("sha256").iterdir())


async def test_pull_by_tag_records_tag_and_repo_digest(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    image = build_image(user="1000")
    registry.put_image("team/app", image, "v1")
    record = await puller.pull("reg.test/team/app:v1")
    assert record.id == image.image_id
    assert record.repo_tags == ["reg.test/team/app:v1"]
    assert record.repo_digests == [f"reg.test/team/app@{image.manifest_digest}"]
    assert record.manifest_digest == image.manifest_digest
    assert record.user == "1000"
    assert sorted(registry.gets("blobs")) == sorted(
        [image.config_digest, *(layer.digest for layer in image.layers)]
    )
    # Layer blobs are gone once unpacked; the config and the manifest stay.
    assert blob_files(store) == sorted(
        d.removeprefix("sha256:") for d in (image.config_digest, image.manifest_digest)
    )
    assert all(store.has_layer(c) for c in record.layers)


async def test_second_pull_fetches_no_blob_and_second_tag_names_the_same_image(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    image = build_image()
    registry.put_image("app", image, "v1")
    registry.put_image("app", image, "stable")
    await puller.pull("reg.test/app:v1")
    registry.requests.clear()
    record = await puller.pull("reg.test/app:stable")
    assert registry.gets("blobs") == []
    assert record.repo_tags == ["reg.test/app:v1", "reg.test/app:stable"]
    assert [r.id for r in store.list()] == [image.image_id]


async def test_pull_by_digest_has_no_tag(registry: FakeRegistry, puller: ImagePuller) -> None:
    image = build_image()
    registry.put_image("app", image, None)
    record = await puller.pull(f"reg.test/app:ignored@{image.manifest_digest}")
    assert record.repo_tags == []
    assert record.repo_digests == [f"reg.test/app@{image.manifest_digest}"]


@pytest.mark.parametrize("media_type", ["oci", "docker"])
async def test_index_fetches_only_this_platforms_image(
    registry: FakeRegistry, puller: ImagePuller, media_type: str
) -> None:
    mine = build_image(extra_files={"platform": b"mine"})
    other = build_image(extra_files={"platform": b"other"})
    index_type = DOCKER_LIST if media_type == "docker" else None
    kwargs = {"media_type": index_type} if index_type else {}
    index_digest = registry.put_index(
        "multi", [(other, platform_dict(OTHER)), (mine, platform_dict(HOST))], "v1", **kwargs
    )
    record = await puller.pull("reg.test/multi:v1")
    assert record.id == mine.image_id
    # The repo digest is the index's: what `name@digest` must resolve to again.
    assert record.repo_digests == [f"reg.test/multi@{index_digest}"]
    fetched = set(registry.gets("blobs")) | set(registry.gets("manifests"))
    assert other.manifest_digest not in fetched and other.config_digest not in fetched
    assert other.layers[2].digest not in fetched
    assert mine.manifest_digest in fetched


async def test_index_without_this_platform_is_not_found(
    registry: FakeRegistry, puller: ImagePuller
) -> None:
    registry.put_index("multi", [(build_image(), platform_dict(OTHER))], "v1")
    with pytest.raises(NotFound, match=f"no image for platform {HOST}"):
        await puller.pull("reg.test/multi:v1")


@pytest.mark.parametrize(("compression", "media_types"), [("zstd", "oci"), ("none", "docker")])
async def test_zstd_and_uncompressed_layers(
    store: ImageStore,
    registry: FakeRegistry,
    puller: ImagePuller,
    compression: str,
    media_types: str,
) -> None:
    image = build_image(compression=compression, media_types=media_types)  # type: ignore[arg-type]
    registry.put_image("app", image, "v1")
    record = await puller.pull("reg.test/app:v1")
    assert (store.layer_path(record.layers[0]) / "diff" / "bin" / "busybox").is_file()


async def test_unknown_tag_is_not_found_naming_the_reference(
    registry: FakeRegistry, puller: ImagePuller
) -> None:
    registry.put_image("app", build_image(), "v1")
    with pytest.raises(NotFound, match=r"image reg\.test/app:nope not found") as info:
        await puller.pull("reg.test/app:nope")
    assert "MANIFEST_UNKNOWN" in str(info.value)


# --- mirrors ---------------------------------------------------------------------------
async def test_mirrors_in_order_then_the_registry(store: ImageStore) -> None:
    down = FakeRegistry("m1.test", down=True)
    empty = FakeRegistry("m2.test")
    good = FakeRegistry("m3.test")
    image = build_image()
    good.put_image("library/busybox", image, "latest")
    mirrors = {"docker.io": ["http://m1.test", "http://m2.test", "http://m3.test"]}
    puller = ImagePuller(store, mirrors=mirrors, transport=fake_transport(down, empty, good))
    try:
        record = await puller.pull("busybox", Credentials("alice", "for-docker-hub"))
    finally:
        await puller.aclose()
    # The image keeps its own name, whichever endpoint served it.
    assert record.repo_tags == ["docker.io/library/busybox:latest"]
    assert record.repo_digests == [f"docker.io/library/busybox@{image.manifest_digest}"]
    assert empty.requests == ["GET /v2/library/busybox/manifests/latest"]
    assert good.requests[0] == "GET /v2/library/busybox/manifests/latest"
    assert set(good.gets("blobs")) == {image.config_digest, *(x.digest for x in image.layers)}


async def test_mirrors_get_no_credentials(store: ImageStore) -> None:
    mirror = FakeRegistry("mirror.test")
    mirror.put_image("library/busybox", build_image(), "latest")
    headers: list[str | None] = []

    def spy(request: httpx.Request) -> httpx.Response | None:
        headers.append(request.headers.get("authorization"))
        return None

    mirror.fail = spy
    puller = ImagePuller(
        store, mirrors={"docker.io": ["http://mirror.test"]}, transport=fake_transport(mirror)
    )
    try:
        await puller.pull("busybox", Credentials("alice", "secret"))
    finally:
        await puller.aclose()
    assert headers and headers == [None] * len(headers)


async def test_every_endpoint_failing_reports_the_registrys_error_and_the_mirrors(
    store: ImageStore,
) -> None:
    upstream = FakeRegistry("reg.test")
    mirror = FakeRegistry("mirror.test", down=True)
    puller = ImagePuller(
        store,
        mirrors={"reg.test": ["http://mirror.test"]},
        transport=fake_transport(upstream, mirror),
    )
    try:
        with pytest.raises(NotFound) as info:
            await puller.pull("reg.test/app:v1")
    finally:
        await puller.aclose()
    message = str(info.value)
    assert "image reg.test/app:v1 not found at https://reg.test" in message
    assert "mirror.test is unreachable" in message


async def test_registry_unreachable_is_unavailable_naming_the_endpoint(
    store: ImageStore,
) -> None:
    puller = ImagePuller(store, ["dead.test:5000"], transport=fake_transport())
    try:
        with pytest.raises(Unavailable, match=r"http://dead\.test:5000 is unreachable"):
            await puller.pull("dead.test:5000/app:v1")
    finally:
        await puller.aclose()


# --- auth ------------------------------------------------------------------------------
async def test_bearer_auth_good_and_bad(store: ImageStore) -> None:
    registry = FakeRegistry("reg.test", auth="token", users={"alice": "pw"})
    registry.put_image("private", build_image(), "v1")
    puller = ImagePuller(store, transport=fake_transport(registry))
    try:
        with pytest.raises(Unauthenticated):
            await puller.pull("reg.test/private:v1", Credentials("alice", "wrong"))
        record = await puller.pull("reg.test/private:v1", Credentials("alice", "pw"))
    finally:
        await puller.aclose()
    assert record.repo_tags == ["reg.test/private:v1"]


# --- shared work ------------------------------------------------------------------------
async def test_concurrent_pulls_share_one_download(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    image = build_image()
    registry.put_image("app", image, "v1")
    registry.put_image("app", image, "v2")
    registry.delay = 0.05
    records = await asyncio.gather(
        *(puller.pull(f"reg.test/app:{'v1' if i % 2 else 'v2'}") for i in range(6))
    )
    assert {r.id for r in records} == {image.image_id}
    assert puller.stats.downloads == 1
    blobs = registry.gets("blobs")
    assert sorted(blobs) == sorted({*blobs}), f"a blob was fetched twice: {blobs}"
    assert len(blobs) == 1 + len(image.layers)
    assert set(store.resolve(image.image_id).repo_tags) == {"reg.test/app:v1", "reg.test/app:v2"}


async def test_concurrent_pulls_of_images_sharing_layers_fetch_each_layer_once(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    first = build_image(extra_files={"one": b"1"})
    second = build_image(extra_files={"two": b"2"})
    assert first.layers[0].digest == second.layers[0].digest
    registry.put_image("one", first, "v1")
    registry.put_image("two", second, "v1")
    registry.delay = 0.05
    a, b = await asyncio.gather(puller.pull("reg.test/one:v1"), puller.pull("reg.test/two:v1"))
    assert a.layers[:2] == b.layers[:2]
    blobs = registry.gets("blobs")
    assert len(blobs) == len(set(blobs)) == 2 + 2 + 2  # two configs, two shared, two own


async def test_a_caller_that_leaves_does_not_stop_the_download_within_the_grace(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    image = build_image()
    registry.put_image("app", image, "v1")
    registry.delay = 0.05
    pull = asyncio.create_task(puller.pull("reg.test/app:v1"))
    await until(registry.gets)  # manifest resolved, blobs on their way
    pull.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pull
    await until(lambda: store.get("reg.test/app:v1"))
    assert store.resolve("reg.test/app:v1").id == image.image_id
    registry.requests.clear()
    await puller.pull("reg.test/app:v1")
    assert registry.gets("blobs") == []


async def test_corrupted_blob_fails_and_keeps_nothing(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    image = build_image()
    registry.put_image("app", image, "v1")
    corrupted = bytearray(image.layers[1].data)
    corrupted[len(corrupted) // 2] ^= 0xFF
    registry.blobs[image.layers[1].digest] = bytes(corrupted)
    with pytest.raises(ContentMismatch, match=image.layers[1].digest):
        await puller.pull("reg.test/app:v1")
    assert store.list() == []
    assert blob_files(store) == []  # not the corrupted blob, nor the good ones
    assert list(store.tmp_dir.iterdir()) == []


async def test_a_blob_longer_than_announced_is_cut_off(
    store: ImageStore, registry: FakeRegistry, puller: ImagePuller
) -> None:
    image = build_image()
    registry.put_image("app", image, "v1")
    digest = image.layers[0].digest

    def longer(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith(digest):
            # Chunked, so no Content-Length gives it away before the body does.
            body = image.layers[0].data + b"trailing garbage"
            return httpx.Response(200, content=_chunks(body))
        return None

    registry.fail = longer
    with pytest.raises(ContentMismatch, match="more than"):
        await puller.pull("reg.test/app:v1")
    assert blob_files(store) == [] and store.list() == []


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), 65536):
        yield data[offset : offset + 65536]


async def test_interrupted_pull_keeps_verified_blobs_and_resumes(
    tmp_path: Path, store: ImageStore, registry: FakeRegistry
) -> None:
    image = build_image()
    registry.put_image("app", image, "v1")
    slow = image.layers[1].digest

    async def stall() -> None:
        await asyncio.sleep(3600)

    def hang(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith(slow):
            return httpx.Response(200, content=_forever())
        return None

    async def _forever() -> AsyncIterator[bytes]:
        yield image.layers[1].data[:1000]
        await stall()

    registry.fail = hang
    puller = ImagePuller(store, transport=fake_transport(registry))
    pull = asyncio.create_task(puller.pull("reg.test/app:v1"))
    await until(lambda: store.has_blob(image.layers[0].digest))
    await puller.aclose()  # what the daemon stopping does
    with pytest.raises((asyncio.CancelledError, Exception)):
        await pull
    # The writing thread removes its temporary file.
    await until(lambda: not list(store.tmp_dir.iterdir()))
    assert store.has_blob(image.layers[0].digest) and not store.has_blob(slow)

    registry.fail = None
    registry.requests.clear()
    again = ImagePuller(store, transport=fake_transport(registry))
    try:
        record = await again.pull("reg.test/app:v1")
    finally:
        await again.aclose()
    assert record.id == image.image_id
    assert image.layers[0].digest not in registry.gets("blobs")
    assert slow in registry.gets("blobs")


def test_the_host_trust_store_is_loaded_at_the_first_tls_connection() -> None:
    context = HostTrustOnFirstUse()
    default = ssl.create_default_context()
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, True)
    assert (context.options, context.verify_flags) == (default.options, default.verify_flags)
    assert context.cert_store_stats()["x509_ca"] == 0  # a plain-HTTP pull loads nothing
    context.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname="registry.example")
    assert context.cert_store_stats() == default.cert_store_stats()
