"""The daemon's image puller, built on the first PullImage rather than at start.

The registry client (httpx, its TLS and HTTP/1.1 machinery) is about 7 MiB of an idle
daemon's memory, which a node that runs only imported or already pulled images never
needs. One puller is built and then kept: its in-flight maps are what lets concurrent
pulls share downloads. It is built on a worker thread: importing httpx and loading the
CA bundle take about 100 ms of CPU, which the first pull would otherwise take from every
call the event loop serves meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cri_shim.config import ImagesConfig
    from cri_shim.images.auth import Credentials
    from cri_shim.images.pull import ImagePuller
    from cri_shim.images.store import ImageStore
    from cri_shim.state.records import ImageRecord


class PullerOnDemand:
    def __init__(self, store: ImageStore, config: ImagesConfig) -> None:
        self._store = store
        self._config = config
        self._puller: ImagePuller | None = None
        self._building = asyncio.Lock()

    async def pull(self, image: str, credentials: Credentials) -> ImageRecord:
        if self._puller is None:
            async with self._building:  # concurrent first pulls build one puller
                if self._puller is None:
                    self._puller = await asyncio.to_thread(self._build)
        return await self._puller.pull(image, credentials)

    def _build(self) -> ImagePuller:
        from cri_shim.images.pull import ImagePuller

        return ImagePuller.from_config(self._store, self._config)

    async def aclose(self) -> None:
        if self._puller is not None:
            await self._puller.aclose()
