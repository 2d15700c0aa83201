"""Pulling images from registries (PullImage): resolve the reference at the registry's
mirrors and then the registry itself, pick this machine's manifest from an index, fetch
only what the store lacks, verify every byte against its digest, and record the image.

Shared work, within the daemon:
- Each pull resolves its reference itself, with its own credentials: the manifest is
  small, and fetching it is what proves the caller may pull the image. The download is
  then shared by every pull of the same manifest digest (two tags of the same content,
  or the same tag twice), and each pull adds its own names to the one image.
- Layer blobs are fetched once however many pulls need them at the same time (in flight
  by blob digest), and not at all when the layer is already unpacked.
- Downloads belong to the puller, not to the request, but they are kept only while
  someone wants them: when the last request waiting on a download has gone, it goes on
  for `abandon_grace` (so that a retry joins it) and is then called off, its fetches in
  flight cancelled and their slots released; the blobs it verified are kept.
- Fairness: the daemon runs `max_concurrent_downloads` layer fetches at once, and one
  registry holds at most `max_downloads_per_registry` of them. Each fetch has a total
  budget (`download_timeout`) and a minimum rate (`download_min_rate` over
  `download_rate_window`, judged on the bytes received, whatever httpx buffers): a
  registry trickling a byte at a time loses its slot within one window.
- A blob becomes visible only complete and verified (the store writes a temporary file
  and renames it). A pull that fails (a digest mismatch, a registry error) discards the
  blobs it fetched that no other pull wants; a pull interrupted by the daemon stopping
  keeps its verified blobs, so the next pull of the image fetches only the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import queue
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from cri_shim import __version__ as _version
from cri_shim import tracing
from cri_shim.config import ImagesConfig, format_duration, format_size
from cri_shim.errors import CriError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from cri_shim.images.auth import ANONYMOUS, Credentials
from cri_shim.images.content import DigestMismatch
from cri_shim.images.layers import LayerBlob, chain_ids
from cri_shim.images.manifest import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    Descriptor,
    Manifest,
    Platform,
    host_platform,
    media_type_of,
    parse_index,
    parse_manifest,
    select_platform,
)
from cri_shim.images.reference import Reference, parse_reference
from cri_shim.images.registry import (
    AuthState,
    ContentMismatch,
    Endpoint,
    FetchedManifest,
    RepositoryClient,
    describe_connection_error,
    endpoints_for,
    first_error,
)
from cri_shim.images.store import ImageStore
from cri_shim.state.records import ImageRecord

log = logging.getLogger(__name__)
# httpx logs every URL at INFO and httpcore every response header at DEBUG: a blob
# redirect's URL is a pre-signed credential for the storage behind the registry, and the
# daemon's own lines already say what was fetched from where.
logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpcore").setLevel(logging.WARNING)

T = TypeVar("T")

# How long a download nobody waits for any more goes on, for a retry to join it.
ABANDON_GRACE = 10.0
MAX_CONFIG_BYTES = 8 << 20
# An index pointing at an index is legal; three levels is more than anything real uses.
_MAX_INDEX_DEPTH = 3
_CHUNK = 1 << 20
# Chunks held between the download and the thread that hashes and writes them: enough to
# keep both busy, few enough that a slow disk slows the download instead of filling RAM.
_PIPE_DEPTH = 8
# The writing thread gives up when no chunk arrives for this long (the download's own
# read timeout is shorter, so this only fires when the event loop is gone).
_STALL_TIMEOUT = 300.0
HTTP_TIMEOUT = httpx.Timeout(30.0, read=60.0, pool=None)


@dataclass(frozen=True)
class ResolvedImage:
    """A reference resolved at one endpoint: the digest it names and this platform's
    manifest. `clients` starts with the endpoint that answered, then the others."""

    reference: Reference
    clients: list[RepositoryClient]
    digest: str  # what the reference names (an index or a manifest): the repo digest
    manifest_digest: str  # this platform's manifest
    manifest_bytes: bytes
    manifest: Manifest

    @property
    def repo_digest(self) -> str:
        return f"{self.reference.name}@{self.digest}"

    @property
    def tags(self) -> list[str]:
        # `name:tag@digest` pins the digest; the tag is informational (as docker parses it).
        if self.reference.digest is not None or self.reference.tag is None:
            return []
        return [self.reference.string()]


@dataclass
class PullStats:
    """What the puller fetched since it started: tests and benchmarks read it."""

    blobs_fetched: int = 0
    bytes_fetched: int = 0
    downloads: int = 0  # image downloads started (shared pulls count once)


class _Interrupted(Exception):
    """The download feeding a blob was abandoned; the blob's temporary file is removed."""


@dataclass(frozen=True)
class _End:
    error: BaseException | None = None


class _ChunkPipe:
    """Hands an HTTP body from the event loop to the worker thread that hashes and writes
    it (`ImageStore.put_blob` is synchronous), at most `_PIPE_DEPTH` chunks ahead. The
    thread never waits on the loop itself, so it cannot hang if the loop goes away."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: queue.SimpleQueue[bytes | _End] = queue.SimpleQueue()
        self._room = asyncio.Semaphore(_PIPE_DEPTH)

    async def send(self, chunk: bytes) -> None:
        await self._room.acquire()
        self._items.put(chunk)

    def close(self, error: BaseException | None = None) -> None:
        self._items.put(_End(error))

    def chunks(self) -> Iterator[bytes]:
        """The thread's side: an iterable for `put_blob`."""
        while True:
            try:
                item = self._items.get(timeout=_STALL_TIMEOUT)
            except queue.Empty:
                raise _Interrupted("no data for the blob arrived in time") from None
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            try:
                self._loop.call_soon_threadsafe(self._room.release)
            except RuntimeError:  # the loop is closed: nobody will finish this download
                raise _Interrupted("the daemon is stopping") from None
            yield item


@dataclass
class _InFlight(Generic[T]):
    """A shared download and the repository it was started for: its endpoints and
    credentials are the ones it uses. `waiters` counts the requests awaiting it."""

    task: asyncio.Task[T]
    owner: str
    waiters: int = 0


@dataclass(frozen=True)
class DownloadLimits:
    """How layer downloads share the daemon; the defaults are `[images]`'s. containerd
    runs 3 per pull; these bound the whole daemon, so that a node pulling many images at
    once does not open dozens of streams to one registry."""

    max_concurrent: int = ImagesConfig.max_concurrent_downloads
    per_registry: int = ImagesConfig.max_downloads_per_registry
    timeout: float = ImagesConfig.download_timeout
    min_rate: int = ImagesConfig.download_min_rate
    rate_window: float = ImagesConfig.download_rate_window
    abandon_grace: float = ABANDON_GRACE

    @classmethod
    def from_config(cls, images: ImagesConfig) -> DownloadLimits:
        return cls(
            images.max_concurrent_downloads,
            images.max_downloads_per_registry,
            images.download_timeout,
            images.download_min_rate,
            images.download_rate_window,
        )


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a task group: a domain error if there is one."""
    leaves: list[BaseException] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    return next((e for e in leaves if isinstance(e, CriError)), leaves[0])


def _diff_ids(config_bytes: bytes, layer_count: int, subject: str) -> list[str]:
    try:
        config = json.loads(config_bytes)
        diff_ids = config["rootfs"]["diff_ids"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        raise InvalidArgument(f"{subject}: the image config has no rootfs.diff_ids") from None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise InvalidArgument(f"{subject}: the image config's rootfs.diff_ids is not a list")
    if len(diff_ids) != layer_count:
        raise InvalidArgument(
            f"{subject}: the image config lists {len(diff_ids)} layers but the manifest "
            f"has {layer_count}"
        )
    return diff_ids


class HostTrustOnFirstUse(ssl.SSLContext):
    """The TLS context of `ssl.create_default_context()`: HTTPS verified against the host's
    trust store (which operators manage) rather than a bundled one. The store is loaded
    when the first TLS connection is made: its certificates cost some 1.6 MiB that a node
    pulling only from plain-HTTP mirrors never needs."""

    _loaded = False

    def __new__(cls) -> HostTrustOnFirstUse:
        return super().__new__(cls, ssl.PROTOCOL_TLS_CLIENT)

    def _load_trust(self) -> None:
        if not self._loaded:
            self.load_default_certs(ssl.Purpose.SERVER_AUTH)
            self._loaded = True

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self._load_trust()
        return super().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        self._load_trust()
        return super().wrap_socket(*args, **kwargs)


class ImagePuller:
    """See the module docstring. One per daemon; `aclose()` cancels what is in flight."""

    def __init__(
        self,
        store: ImageStore,
        insecure_registries: Sequence[str] = (),
        mirrors: Mapping[str, Sequence[str]] | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        platform: Platform | None = None,
        limits: DownloadLimits | None = None,
    ) -> None:
        self.store = store
        self.insecure_registries = list(insecure_registries)
        self.mirrors = {k: list(v) for k, v in (mirrors or {}).items()}
        self.platform = platform or host_platform()
        self.stats = PullStats()
        verify: ssl.SSLContext | bool = HostTrustOnFirstUse() if transport is None else True
        self._http = httpx.AsyncClient(
            transport=transport,
            verify=verify,
            timeout=HTTP_TIMEOUT,
            follow_redirects=True,
            headers={"User-Agent": f"cri-shim/{_version}"},
        )
        self._auth = AuthState()
        self.limits = limits or DownloadLimits()
        self._slots = asyncio.Semaphore(self.limits.max_concurrent)
        # One per registry, taken before a daemon-wide slot: however slow one registry is,
        # it holds at most `per_registry` of them.
        self._registry_slots: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._images: dict[str, _InFlight[ImageRecord]] = {}
        self._blobs: dict[str, _InFlight[None]] = {}
        # How many image downloads in flight need each layer blob: a failed pull discards
        # a blob only when nobody else is about to unpack it.
        self._wanted: Counter[str] = Counter()

    @classmethod
    def from_config(cls, store: ImageStore, config: ImagesConfig) -> ImagePuller:
        return cls(
            store,
            config.insecure_registries,
            config.mirrors,
            limits=DownloadLimits.from_config(config),
        )

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        # Retrieved here so that a shared download whose waiters all left does not end in
        # "exception was never retrieved"; whoever still waits gets it from the task.
        if not task.cancelled() and (error := task.exception()) is not None:
            log.debug("%s ended: %s", task.get_name(), error)

    # --- the entry point -------------------------------------------------------------
    async def pull(self, image: str, credentials: Credentials = ANONYMOUS) -> ImageRecord:
        """Pull `image` (any reference form: `busybox`, `host:5000/a/b:tag`,
        `name@sha256:…`) and return the stored image, named by the reference's tag and
        its repo digest. Cancelling the caller leaves the shared download running."""
        reference = parse_reference(image)
        started = time.monotonic()
        resolved = await self.resolve(reference, credentials)
        record = await self._join_or_start(resolved)
        wanted_tags, wanted_digests = resolved.tags, [resolved.repo_digest]
        if not (set(wanted_tags) <= set(record.repo_tags)) or not (
            set(wanted_digests) <= set(record.repo_digests)
        ):
            record = await asyncio.to_thread(self._add_names, record, resolved)
        log.info(
            "pulled %s as %s in %.2fs (repo digest %s)",
            reference,
            record.id,
            time.monotonic() - started,
            resolved.repo_digest,
        )
        return record

    async def _join_or_start(self, resolved: ResolvedImage) -> ImageRecord:
        """The download of this manifest: the one in flight, or a new one."""
        key, own = resolved.manifest_digest, resolved.reference.name
        for attempt in range(2):
            entry = self._images.get(key)
            if entry is None:
                task = self._spawn(self._download(resolved), name=f"pull {resolved.reference}")
                entry = self._images[key] = _InFlight(task, own)
                task.add_done_callback(functools.partial(self._forget, self._images, key))
            else:
                log.info("pull %s: joining the download of %s", resolved.reference, key)
            entry.waiters += 1
            try:
                return await asyncio.shield(entry.task)
            except ContentMismatch:
                raise
            except CriError as exc:
                # A pull of the same content under another name failed, maybe for want of
                # access there (its endpoints, its credentials): one try of our own.
                if attempt or entry.owner == own:
                    raise
                log.info("pull %s: the shared download failed (%s); again", own, exc)
            finally:
                entry.waiters -= 1
                if not entry.waiters and not entry.task.done():
                    self._abandon_later(entry, resolved)
        raise AssertionError("unreachable")

    def _abandon_later(self, entry: _InFlight[ImageRecord], resolved: ResolvedImage) -> None:
        """The last request waiting on `entry` has gone: unless one joins within the grace,
        call the download off, so that its slots go to pulls someone waits for."""

        def call_off() -> None:
            if entry.waiters or entry.task.done():
                return
            log.info(
                "pull %s: no request waits for it any more; download called off",
                resolved.reference,
            )
            entry.task.cancel()

        asyncio.get_running_loop().call_later(self.limits.abandon_grace, call_off)

    @staticmethod
    def _forget(table: dict[str, _InFlight[Any]], key: str, task: asyncio.Task[Any]) -> None:
        entry = table.get(key)
        if entry is not None and entry.task is task:
            del table[key]

    # --- resolving ---------------------------------------------------------------------
    def clients_for(self, reference: Reference, credentials: Credentials) -> list[RepositoryClient]:
        endpoints = endpoints_for(reference.registry, self.insecure_registries, self.mirrors)
        return [self._client(e, reference.repository, credentials) for e in endpoints]

    def _client(
        self, endpoint: Endpoint, repository: str, credentials: Credentials
    ) -> RepositoryClient:
        # A request's credentials are for the registry, so a mirror is asked anonymously.
        sent = ANONYMOUS if endpoint.mirror else credentials
        return RepositoryClient(self._http, endpoint, repository, sent, self._auth)

    async def resolve(self, reference: Reference, credentials: Credentials) -> ResolvedImage:
        """Try each endpoint in order until one resolves the reference to a manifest for
        this platform; the registry's own answer decides the error when none does."""
        clients = self.clients_for(reference, credentials)
        errors: list[tuple[Endpoint, CriError]] = []
        for index, client in enumerate(clients):
            try:
                async with self._budget(f"image {reference} at {client.endpoint}"):
                    digest, fetched, manifest = await self._resolve_at(client, reference)
            except CriError as exc:
                if client.endpoint.mirror:
                    log.info("pull %s: mirror %s failed: %s", reference, client.endpoint, exc)
                errors.append((client.endpoint, exc))
                continue
            log.info(
                "pull %s: %s resolved to %s at %s%s",
                reference,
                reference.digest or reference.tag,
                digest,
                client.endpoint,
                " (mirror)" if client.endpoint.mirror else "",
            )
            ordered = [client, *clients[:index], *clients[index + 1 :]]
            return ResolvedImage(reference, ordered, digest, fetched.digest, fetched.data, manifest)
        raise first_error(errors)

    async def _resolve_at(
        self, client: RepositoryClient, reference: Reference
    ) -> tuple[str, FetchedManifest, Manifest]:
        subject = f"image {reference}"
        name = reference.digest or reference.tag or "latest"
        fetched = await client.get_manifest(name, subject, reference.digest)
        top_digest = fetched.digest
        for _depth in range(_MAX_INDEX_DEPTH):
            media_type = fetched.media_type
            if media_type not in INDEX_TYPES | MANIFEST_TYPES:
                media_type = media_type_of(fetched.data, f"manifest of {subject}")
            if media_type not in INDEX_TYPES:
                return top_digest, fetched, parse_manifest(fetched.data, f"manifest of {subject}")
            entries = parse_index(fetched.data, f"index of {subject}")
            try:
                chosen = select_platform(entries, self.platform, f"index of {subject}")
            except InvalidArgument as exc:
                raise NotFound(str(exc)) from None
            fetched = await client.get_manifest(
                chosen.digest,
                f"{subject} ({self.platform} manifest {chosen.digest})",
                chosen.digest,
            )
        raise InvalidArgument(f"{subject}: indexes nested more than {_MAX_INDEX_DEPTH} deep")

    # --- downloading -------------------------------------------------------------------
    async def _download(self, resolved: ResolvedImage) -> ImageRecord:
        """Fetch what the store lacks and add the image (shared by concurrent pulls)."""
        self.stats.downloads += 1
        subject = f"image {resolved.reference}"
        layers = resolved.manifest.layers
        config_bytes = await self._config(resolved, subject)
        chains = chain_ids(_diff_ids(config_bytes, len(layers), subject))
        digests = [layer.digest for layer in layers]
        self._wanted.update(digests)
        failed = abandoned = False
        try:
            # Twice at most: a layer seen unpacked may be garbage-collected (its image
            # removed) before add_image commits; the second round fetches it after all.
            for attempt in range(2):
                await self._ensure_blobs(resolved, chains, subject)
                try:
                    return await asyncio.to_thread(
                        self.store.add_image,
                        config_bytes,
                        [LayerBlob(layer.digest, layer.media_type) for layer in layers],
                        resolved.manifest_digest,
                        resolved.tags,
                        [resolved.repo_digest],
                        resolved.manifest_bytes,
                    )
                except FailedPrecondition:
                    if attempt:
                        raise
                    log.info("pull %s: a layer went missing while adding it; again", subject)
            raise AssertionError("unreachable")
        except CriError:
            failed = True
            raise
        except asyncio.CancelledError:
            # Abandoned (or the daemon stopping): fetches nobody else wants are called off,
            # what they verified already is kept for the next pull.
            abandoned = True
            raise
        finally:
            called_off = self._release(digests, discard=failed, call_off=failed or abandoned)
            # Reported only once they are gone: "failed" means nothing kept. A fetch that
            # finished its blob just before it was called off leaves it for us to delete.
            await asyncio.gather(*called_off.values(), return_exceptions=True)
            for digest in called_off:
                if failed and not self._wanted.get(digest) and digest not in self._blobs:
                    self._discard(digest)

    async def _config(self, resolved: ResolvedImage, subject: str) -> bytes:
        descriptor = resolved.manifest.config
        if self.store.has_blob(descriptor.digest):
            return self.store.read_blob(descriptor.digest)
        errors: list[tuple[Endpoint, CriError]] = []
        for client in resolved.clients:
            what = f"config {descriptor.digest} of {subject}"
            try:
                async with self._budget(what):
                    return await client.get_blob(
                        descriptor.digest, descriptor.size, MAX_CONFIG_BYTES, what
                    )
            except ContentMismatch:
                raise
            except CriError as exc:
                errors.append((client.endpoint, exc))
        raise first_error(errors)

    async def _ensure_blobs(self, resolved: ResolvedImage, chains: list[str], subject: str) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for layer, chain in zip(resolved.manifest.layers, chains, strict=True):
                    group.create_task(self._ensure_blob(resolved, layer, chain, subject))
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None

    async def _ensure_blob(
        self, resolved: ResolvedImage, layer: Descriptor, chain: str, subject: str
    ) -> None:
        """The layer is unpacked, or its blob is in the store, when this returns."""
        own = resolved.reference.name
        retried = False
        while True:
            entry = self._blobs.get(layer.digest)
            if entry is None:
                # Blob first, then layer: add_image renames the layer into place before it
                # deletes the blob, so a blob gone by now means the layer is there.
                if self.store.has_blob(layer.digest) or self.store.has_layer(chain):
                    return
                task = self._spawn(
                    self._fetch_blob(resolved, layer, subject), name=f"fetch {layer.digest}"
                )
                entry = self._blobs[layer.digest] = _InFlight(task, own)
                task.add_done_callback(functools.partial(self._forget, self._blobs, layer.digest))
            try:
                await asyncio.shield(entry.task)
                return
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if entry.task.cancelled() and current is not None and not current.cancelling():
                    continue  # called off because the pull that wanted it failed: fetch anew
                raise
            except ContentMismatch:
                raise
            except CriError as exc:
                # Another image's fetch of the same blob failed: its endpoints or
                # credentials are not ours, so try once with our own before giving up.
                if retried or entry.owner == own:
                    raise
                retried = True
                log.info(
                    "pull %s: shared fetch of %s failed (%s); fetching it again",
                    subject,
                    layer.digest,
                    exc,
                )

    async def _fetch_blob(self, resolved: ResolvedImage, layer: Descriptor, subject: str) -> None:
        what = f"layer {layer.digest} of {subject}"
        registry = resolved.reference.registry
        per_registry = self._registry_slots.setdefault(
            registry, asyncio.Semaphore(self.limits.per_registry)
        )
        async with per_registry, self._slots, self._budget(what):
            with tracing.span(
                "layer download",
                **{"oci.layer.digest": layer.digest, "oci.layer.size": layer.size},
            ):
                await self._fetch_from_endpoints(resolved, layer, what)
        if not self._wanted.get(layer.digest):
            # Every pull that wanted it failed meanwhile: nobody will unpack it.
            self._discard(layer.digest)

    @contextlib.asynccontextmanager
    async def _budget(self, what: str) -> AsyncIterator[None]:
        """`download_timeout` for one download: a registry that answers, slowly, for ever
        fails it rather than holding it (and whatever it holds) up."""
        try:
            async with asyncio.timeout(self.limits.timeout):
                yield
        except TimeoutError:
            raise Unavailable(
                f"{what}: not downloaded within {format_duration(self.limits.timeout)} "
                "(images.download_timeout)"
            ) from None

    async def _fetch_from_endpoints(
        self, resolved: ResolvedImage, layer: Descriptor, what: str
    ) -> None:
        errors: list[tuple[Endpoint, CriError]] = []
        for client in resolved.clients:
            try:
                async with client.open_blob(layer.digest, what) as response:
                    await self._receive(response, layer, client.endpoint, what)
                return
            except ContentMismatch:
                raise
            except CriError as exc:
                errors.append((client.endpoint, exc))
        raise first_error(errors)

    async def _receive(
        self, response: httpx.Response, layer: Descriptor, endpoint: Endpoint, what: str
    ) -> None:
        """Stream the body into the store through a worker thread, checking the size as
        it comes (a registry that sends more than announced is cut off early)."""
        announced = response.headers.get("content-length")
        if announced is not None and announced.isdigit():
            if int(announced) != layer.size:
                raise ContentMismatch(
                    f"{what}: {endpoint} sends {announced} bytes, the manifest says {layer.size}"
                )
        pipe = _ChunkPipe(asyncio.get_running_loop())
        received = 0
        started = time.monotonic()

        async def pump() -> None:
            nonlocal received
            try:
                async for chunk in response.aiter_bytes(_CHUNK):
                    received += len(chunk)
                    if received > layer.size:
                        too_long = f"{endpoint} sent more than the {layer.size} bytes announced"
                        pipe.close(ContentMismatch(f"{what}: {too_long}"))
                        return
                    await pipe.send(chunk)
            except httpx.HTTPError as exc:
                pipe.close(Unavailable(describe_connection_error(endpoint, exc)))
                return
            except BaseException:
                pipe.close(_Interrupted("the download was cancelled"))
                raise
            pipe.close()

        feeder = asyncio.create_task(pump(), name=f"receive {layer.digest}")
        watchdog = asyncio.create_task(
            self._watch_rate(response, pipe, feeder, endpoint, what), name=f"rate {layer.digest}"
        )
        writer = asyncio.ensure_future(
            asyncio.to_thread(self.store.put_blob, pipe.chunks(), layer.digest, layer.size)
        )
        # Retrieved whatever happens: a second cancellation (the daemon stopping while the
        # download is called off) may leave the wait below before the thread has ended.
        writer.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            await asyncio.shield(writer)
        except DigestMismatch as exc:  # the store's check, as the last byte was written
            raise ContentMismatch(f"{what} from {endpoint}: {exc}") from None
        finally:
            # The thread may have stopped early (disk full): the feeder must not wait on it.
            # Cancelled, the feeder closes the pipe, and the thread then removes its
            # temporary file; waiting for that keeps "called off" meaning "nothing left".
            watchdog.cancel()
            feeder.cancel()
            await asyncio.gather(feeder, watchdog, return_exceptions=True)
            # A feeder cancelled before it ran closed nothing; a second end is ignored.
            pipe.close(_Interrupted("the download was called off"))
            if not writer.done():
                await asyncio.wait([writer])
            if writer.done() and not writer.cancelled():
                writer.exception()  # retrieved: raised above, or moot when cancelled
        self.stats.blobs_fetched += 1
        self.stats.bytes_fetched += received
        log.debug(
            "%s: %d bytes from %s in %.3fs", what, received, endpoint, time.monotonic() - started
        )

    async def _watch_rate(
        self,
        response: httpx.Response,
        pipe: _ChunkPipe,
        feeder: asyncio.Task[None],
        endpoint: Endpoint,
        what: str,
    ) -> None:
        """Cut the download off when fewer than `min_rate` bytes a second arrived over the
        last window. Counted on the wire (httpx's own count): a trickle fills no chunk, so
        the body iterator alone would never notice it, nor would a per-read timeout."""
        limits = self.limits
        if limits.min_rate <= 0:
            return
        mark = response.num_bytes_downloaded
        while True:
            await asyncio.sleep(limits.rate_window)
            received = response.num_bytes_downloaded
            rate = (received - mark) / limits.rate_window
            if rate < limits.min_rate:
                pipe.close(
                    Unavailable(
                        f"{what}: {endpoint} sent {rate:.0f} bytes/s over the last "
                        f"{format_duration(limits.rate_window)}, below "
                        f"{format_size(limits.min_rate)}/s (images.download_min_rate)"
                    )
                )
                feeder.cancel()
                return
            mark = received

    def _release(
        self, digests: list[str], discard: bool, call_off: bool
    ) -> dict[str, asyncio.Task[None]]:
        """This download no longer needs `digests`. With `call_off`, fetches in flight
        that no other download wants are cancelled (returned, for the caller to await);
        when it failed (`discard`), fetched blobs nobody wants are deleted as well."""
        self._wanted.subtract(digests)
        called_off: dict[str, asyncio.Task[None]] = {}
        for digest in set(digests):
            if self._wanted[digest] > 0:
                continue
            del self._wanted[digest]
            entry = self._blobs.get(digest)
            if entry is not None and call_off:
                if not entry.task.cancelling():  # already called off (the daemon stopping)
                    entry.task.cancel()
                called_off[digest] = entry.task
            elif entry is None and discard:
                self._discard(digest)
        return called_off

    def _discard(self, digest: str) -> None:
        if self.store.keep_layer_blobs:
            return
        path = self.store.blob_path(digest)
        if path.exists():
            path.unlink(missing_ok=True)
            log.info("discarded blob %s: the pull that fetched it failed", digest)

    def _add_names(self, record: ImageRecord, resolved: ResolvedImage) -> ImageRecord:
        """Give the image this pull's tag and repo digest (another pull downloaded it).
        Cheap: every layer is unpacked, so add_image only merges the names."""
        return self.store.add_image(
            self.store.read_blob(record.id),
            [LayerBlob(layer.digest, layer.media_type) for layer in resolved.manifest.layers],
            resolved.manifest_digest,
            resolved.tags,
            [resolved.repo_digest],
            resolved.manifest_bytes,
        )
