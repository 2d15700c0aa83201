"""Layer downloads share the daemon fairly: a registry
trickling bytes is cut off below the minimum rate, a download has a total budget, one
registry cannot hold every slot, and a download nobody waits for gives its slot back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from cri_shim.config import ConfigError, config_from_dict
from cri_shim.errors import Unavailable
from cri_shim.images.pull import DownloadLimits, ImagePuller
from cri_shim.images.store import ImageStore
from tests.hostile_layers import Tar, image_of_layers
from tests.imagebuild import BuiltImage, build_image
from tests.registry import FakeRegistry, fake_transport
from tests.waiting import until

IMAGE = build_image()
# Shares no layer with IMAGE: a layer fetch is shared by digest, whichever registry serves it.
OTHER = image_of_layers([Tar().file("other", b"other image").bytes()])


def stalled(
    image: BuiltImage,
    started: asyncio.Event | None = None,
    rate: float = 0.0,
    bodies: list[bytes] | None = None,
) -> Callable:
    """A `fail` hook whose layer bodies send one byte every `rate` seconds (never, at 0);
    `started` is set, and `bodies` appended to, as each body starts."""
    layers = {layer.digest: layer.data for layer in image.layers}

    async def body(data: bytes) -> AsyncIterator[bytes]:
        if started is not None:
            started.set()
        if bodies is not None:
            bodies.append(data)
        for index in range(len(data)):
            await asyncio.sleep(rate or 3600)
            yield data[index : index + 1]

    def hook(request: httpx.Request) -> httpx.Response | None:
        digest = request.url.path.rpartition("/")[2]
        if digest in layers:
            return httpx.Response(200, content=body(layers[digest]))
        return None

    return hook


async def pulled(puller: ImagePuller, image: str, within: float) -> str:
    return (await asyncio.wait_for(puller.pull(image), within)).id


async def test_a_trickling_registry_is_cut_off_below_the_minimum_rate(store: ImageStore) -> None:
    registry = FakeRegistry("slow.test")
    registry.put_image("app", IMAGE, "v1")
    registry.fail = stalled(IMAGE, rate=0.05)  # 20 bytes/s, as one byte every half second
    limits = DownloadLimits(min_rate=1000, rate_window=0.3)
    puller = ImagePuller(store, transport=fake_transport(registry), limits=limits)
    try:
        with pytest.raises(Unavailable, match=r"bytes/s.*images\.download_min_rate"):
            await asyncio.wait_for(puller.pull("slow.test/app:v1"), 5)
    finally:
        await puller.aclose()
    assert store.list() == [] and list(store.tmp_dir.iterdir()) == []


async def test_a_download_past_its_budget_fails_naming_the_key(store: ImageStore) -> None:
    registry = FakeRegistry("slow.test")
    registry.put_image("app", IMAGE, "v1")
    registry.fail = stalled(IMAGE)
    limits = DownloadLimits(timeout=0.3, min_rate=0)
    puller = ImagePuller(store, transport=fake_transport(registry), limits=limits)
    try:
        with pytest.raises(Unavailable, match=r"within 300ms \(images\.download_timeout\)"):
            await asyncio.wait_for(puller.pull("slow.test/app:v1"), 5)
    finally:
        await puller.aclose()


async def test_one_registry_cannot_hold_every_slot(store: ImageStore) -> None:
    slow, fast = FakeRegistry("slow.test"), FakeRegistry("fast.test")
    others = [build_image(extra_files={"etc/n": str(n).encode()}) for n in range(3)]
    for n, image in enumerate([IMAGE, *others]):
        slow.put_image(f"app{n}", image, "v1")
    fast.put_image("app", OTHER, "v1")
    bodies: list[bytes] = []
    slow.fail = stalled(IMAGE, bodies=bodies)
    for image in others:
        hook = stalled(image, bodies=bodies)
        previous = slow.fail

        def both(request: httpx.Request, hook: Callable = hook, previous: Callable = previous):
            return hook(request) or previous(request)

        slow.fail = both
    limits = DownloadLimits(max_concurrent=4, per_registry=2, min_rate=0)
    puller = ImagePuller(store, transport=fake_transport(slow, fast), limits=limits)
    hung = [asyncio.create_task(puller.pull(f"slow.test/app{n}:v1")) for n in range(4)]
    try:
        # Every slot the slow registry can get, taken.
        await until(lambda: len(bodies) >= limits.per_registry, timeout=5)
        assert await pulled(puller, "fast.test/app:v1", 5) == OTHER.image_id
    finally:
        for task in hung:
            task.cancel()
        await puller.aclose()


async def test_a_download_nobody_waits_for_gives_its_slot_back(store: ImageStore) -> None:
    slow, fast = FakeRegistry("slow.test"), FakeRegistry("fast.test")
    slow.put_image("app", IMAGE, "v1")
    fast.put_image("app", OTHER, "v1")
    started = asyncio.Event()
    slow.fail = stalled(IMAGE, started)
    limits = DownloadLimits(max_concurrent=1, min_rate=0, abandon_grace=0.1)
    puller = ImagePuller(store, transport=fake_transport(slow, fast), limits=limits)
    try:
        request = asyncio.create_task(puller.pull("slow.test/app:v1"))
        await asyncio.wait_for(started.wait(), 5)
        request.cancel()  # the client has gone: kubelet's context, crictl's Ctrl-C
        with pytest.raises(asyncio.CancelledError):
            await request
        assert await pulled(puller, "fast.test/app:v1", 5) == OTHER.image_id
    finally:
        await puller.aclose()
    assert list(store.tmp_dir.iterdir()) == []


def test_download_limits_come_from_the_config() -> None:
    images = {
        "max_concurrent_downloads": 8,
        "max_downloads_per_registry": 3,
        "download_timeout": "20m",
        "download_min_rate": "1KiB",
        "download_rate_window": "1m",
    }
    limits = DownloadLimits.from_config(config_from_dict({"images": images}).images)
    assert limits == DownloadLimits(8, 3, 1200.0, 1024, 60.0)
    off = config_from_dict({"images": {"download_min_rate": "0B"}}).images
    assert DownloadLimits.from_config(off).min_rate == 0
    with pytest.raises(ConfigError, match=r"images\.download_timeout"):
        config_from_dict({"images": {"download_timeout": "0s"}})


@pytest.mark.parametrize("what", ["manifests/v1", f"blobs/{IMAGE.config_digest}"])
async def test_a_manifest_or_config_that_never_ends_fails_within_the_budget(
    store: ImageStore, what: str
) -> None:
    registry = FakeRegistry("slow.test")
    registry.put_image("app", IMAGE, "v1")

    async def never() -> AsyncIterator[bytes]:
        yield b"{"
        await asyncio.sleep(3600)

    def hook(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith(what):
            return httpx.Response(200, content=never())
        return None

    registry.fail = hook
    puller = ImagePuller(
        store, transport=fake_transport(registry), limits=DownloadLimits(timeout=0.3)
    )
    try:
        with pytest.raises(Unavailable, match=r"images\.download_timeout"):
            await asyncio.wait_for(puller.pull("slow.test/app:v1"), 5)
    finally:
        await puller.aclose()
