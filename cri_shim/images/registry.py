"""Registry API v2 over httpx: where a registry's content can be fetched from (its mirrors,
then the registry itself) and one repository's manifests and blobs at one endpoint, with the
authentication handshake (anonymous, basic, bearer token).

Errors are domain errors that name the endpoint and what was asked for: 404 `NotFound`,
401 `Unauthenticated`, 403 `PermissionDenied`, no connection / 5xx / 429 `Unavailable`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx

from cri_shim.config import redact_userinfo
from cri_shim.errors import (
    CriError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from cri_shim.images.auth import (
    Challenge,
    Credentials,
    Token,
    TokenCache,
    fetch_token,
    parse_www_authenticate,
    read_capped,
    repository_scope,
)
from cri_shim.images.manifest import DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST

log = logging.getLogger(__name__)

DOCKER_HUB = "docker.io"
# Docker Hub's API host: `docker.io` itself only redirects browsers.
DOCKER_HUB_HOST = "registry-1.docker.io"
_DOCKER_HUB_ALIASES = ("index.docker.io", DOCKER_HUB_HOST)
# Most specific first; a registry answers with the first it has.
MANIFEST_ACCEPT = ", ".join((OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST))
SCHEMA1_TYPES = frozenset(
    {
        "application/vnd.docker.distribution.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v1+prettyjws",
    }
)
MAX_MANIFEST_BYTES = 4 << 20
_MAX_ERROR_BODY = 64 << 10


class ContentMismatch(FailedPrecondition):
    """What a registry sent does not hash to the digest (or size) it was asked for:
    corrupted in its storage or on the way, or a misbehaving mirror. The pull fails and
    keeps nothing. FAILED_PRECONDITION, as containerd answers it: the request was fine,
    the content was not."""


@dataclass(frozen=True)
class Endpoint:
    """Where to send API requests: `scheme://host[:port][/prefix]`, without `/v2`."""

    url: str
    mirror: bool = False

    def api(self, path: str) -> str:
        return f"{self.url}/v2/{path}"

    def __str__(self) -> str:
        # A mirror written as http://user:pass@host must not put its password in messages.
        parsed = httpx.URL(self.url)
        if parsed.userinfo:
            return str(parsed.copy_with(username=None, password=None))
        return self.url

    def __repr__(self) -> str:
        # Reprs reach logs and tracebacks too (a ResolvedImage holds its endpoints).
        return f"Endpoint({str(self)!r}, mirror={self.mirror})"


def is_insecure(host: str, insecure_registries: Sequence[str]) -> bool:
    """`host` (`name[:port]`) is listed as is, or its name is listed without a port."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    for entry in insecure_registries:
        entry = entry.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        if entry == host or entry == name:
            return True
    return False


def _endpoint_url(text: str, insecure_registries: Sequence[str], where: str) -> str:
    text = text.strip().rstrip("/")
    if "://" not in text:
        # No scheme: HTTPS, unless the host is an insecure registry (as containerd does).
        host = text.split("/", 1)[0]
        text = f"{'http' if is_insecure(host, insecure_registries) else 'https'}://{text}"
    shown = redact_userinfo(text)  # a mirror's password stays out of the message
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL:
        raise FailedPrecondition(f"{where}: endpoint {shown!r} is not a URL") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise FailedPrecondition(f"{where}: endpoint {shown!r} is not an http(s) URL")
    return str(url).rstrip("/").removesuffix("/v2")


def endpoints_for(
    registry: str,
    insecure_registries: Sequence[str] = (),
    mirrors: Mapping[str, Sequence[str]] | None = None,
) -> list[Endpoint]:
    """The endpoints to try for `registry` (a normalised reference's registry part):
    its mirrors in the configured order, then the registry itself. Plain HTTP only for a
    mirror written `http://…` and for insecure registries."""
    result: list[Endpoint] = []
    configured = mirrors or {}
    key = registry
    if registry == DOCKER_HUB and registry not in configured:
        # Docker Hub's other names, as people write them in mirror configurations.
        key = next((a for a in _DOCKER_HUB_ALIASES if a in configured), registry)
    for text in configured.get(key, ()):
        url = _endpoint_url(text, insecure_registries, f"images.mirrors.{key}")
        result.append(Endpoint(url, mirror=True))
    host = DOCKER_HUB_HOST if registry == DOCKER_HUB else registry
    insecure = is_insecure(registry, insecure_registries) or is_insecure(host, insecure_registries)
    own = Endpoint(f"{'http' if insecure else 'https'}://{host}")
    # A mirror that is the registry itself adds nothing but a second try.
    return [e for e in result if e.url != own.url] + [own]


@dataclass(frozen=True)
class FetchedManifest:
    """A manifest or index as the registry sent it, with the digest of those bytes."""

    data: bytes
    media_type: str
    digest: str


@dataclass
class AuthState:
    """What every client of one endpoint learns: its last challenge, so that the next
    client authorises up front instead of paying a 401 round trip first."""

    tokens: TokenCache = field(default_factory=TokenCache)
    challenges: dict[str, Challenge] = field(default_factory=dict)


def _registry_errors(body: bytes) -> str:
    """` (CODE: message; …)` from a registry's JSON error body, or ""."""
    try:
        doc = json.loads(body)
        errors = doc.get("errors") if isinstance(doc, dict) else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(errors, list):
        return ""
    parts = []
    for error in errors[:3]:
        if isinstance(error, dict):
            code, message = str(error.get("code", "")), str(error.get("message", ""))
            parts.append(f"{code}: {message}" if code and message else code or message)
    text = "; ".join(p for p in parts if p)[:300]
    return f" ({text})" if text else ""


def describe_connection_error(endpoint: Endpoint | str, exc: httpx.HTTPError) -> str:
    text = f"registry endpoint {endpoint} is unreachable: {type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectError) and "SSL" in str(exc):
        text += " (if it serves plain HTTP, list it in [images] insecure_registries)"
    return text


class RepositoryClient:
    """One repository at one endpoint. Sends the credentials only where they belong: the
    caller gives a mirror `ANONYMOUS`, since credentials for a registry are not a mirror's
    business (containerd does the same)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        endpoint: Endpoint,
        repository: str,
        credentials: Credentials,
        auth: AuthState,
    ) -> None:
        self.http = http
        self.endpoint = endpoint
        self.repository = repository
        self.credentials = credentials
        self._auth = auth
        self._authorization: str | None = None
        if credentials.registry_token:
            self._authorization = f"Bearer {credentials.registry_token}"

    def __repr__(self) -> str:
        return f"RepositoryClient({self.endpoint}, {self.repository!r})"

    # --- authentication ------------------------------------------------------------------
    def _token_key(self, challenge: Challenge, scope: str) -> tuple[str, str, str, str]:
        service = challenge.params.get("service", "")
        return (challenge.realm, service, scope, self.credentials.fingerprint())

    async def _bearer(self, challenge: Challenge, use_cache: bool) -> str:
        scope = challenge.params.get("scope") or repository_scope(self.repository)
        key = self._token_key(challenge, scope)
        token: Token | None = self._auth.tokens.get(key) if use_cache else None
        if token is None:
            token = await fetch_token(
                self.http, challenge, scope, self.credentials, self.endpoint.url
            )
            self._auth.tokens.put(key, token)
        return f"Bearer {token.value}"

    async def _authorize_up_front(self) -> None:
        """Authorise before the first request when this endpoint challenged before."""
        if self._authorization is not None:
            return
        known = self._auth.challenges.get(self.endpoint.url)
        if known is None:
            return
        if known.scheme == "bearer":
            # The repository's own scope: the remembered challenge may be another's.
            params = {k: v for k, v in known.params.items() if k != "scope"}
            self._authorization = await self._bearer(Challenge("bearer", params), True)
        elif known.scheme == "basic" and self.credentials.has_basic:
            self._authorization = self.credentials.basic_header()

    async def _authorize(self, challenges: list[Challenge], subject: str) -> None:
        """Answer a 401: a bearer token if offered, else basic credentials."""
        if self.credentials.registry_token:
            raise Unauthenticated(f"{subject}: {self.endpoint} refused the registry token (401)")
        retry = self._authorization is not None  # what we sent was refused: no cached token
        bearer = next((c for c in challenges if c.scheme == "bearer" and c.realm), None)
        if bearer is not None:
            self._auth.challenges[self.endpoint.url] = bearer
            self._authorization = await self._bearer(bearer, use_cache=not retry)
            return
        if any(c.scheme == "basic" for c in challenges):
            self._auth.challenges[self.endpoint.url] = Challenge("basic")
            if not self.credentials.has_basic:
                raise Unauthenticated(
                    f"{subject}: {self.endpoint} requires credentials and none were given"
                )
            if retry:
                raise Unauthenticated(f"{subject}: {self.endpoint} refused the credentials (401)")
            self._authorization = self.credentials.basic_header()
            return
        raise Unauthenticated(f"{subject}: {self.endpoint} answered 401 with no usable challenge")

    # --- requests ------------------------------------------------------------------------
    async def _send(self, url: str, headers: dict[str, str], subject: str) -> httpx.Response:
        """GET `url` (streamed), answering one 401 by authorising; any other status is
        returned for the caller to judge."""
        await self._authorize_up_front()
        for attempt in range(2):
            sent = dict(headers)
            if self._authorization is not None:
                sent["Authorization"] = self._authorization
            request = self.http.build_request("GET", url, headers=sent)
            try:
                response = await self.http.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise Unavailable(describe_connection_error(self.endpoint, exc)) from None
            if response.status_code != 401 or attempt == 1:
                return response
            challenges = parse_www_authenticate(response.headers.get_list("www-authenticate"))
            await response.aclose()
            await self._authorize(challenges, subject)
        raise AssertionError("unreachable")

    async def _check(self, response: httpx.Response, subject: str) -> None:
        """Raise the domain error for a status other than 200, closing the response."""
        status = response.status_code
        if status == 200:
            return
        try:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > _MAX_ERROR_BODY:
                    break
        except httpx.HTTPError:
            body = b""
        finally:
            await response.aclose()
        detail = _registry_errors(body)
        where = f"{self.endpoint}"
        if status == 404:
            raise NotFound(f"{subject} not found at {where}{detail}")
        if status == 401:
            challenges = parse_www_authenticate(response.headers.get_list("www-authenticate"))
            if not self.credentials.anonymous and any(
                c.params.get("error") == "insufficient_scope" for c in challenges
            ):
                # The token server took the credentials but granted less than a pull.
                raise PermissionDenied(
                    f"{subject}: the credentials are valid but do not allow pulling "
                    f"{self.repository} from {where} (401 insufficient_scope{detail})"
                )
            if self.credentials.anonymous:
                raise Unauthenticated(
                    f"{subject}: {where} requires authentication (401{detail}); no credentials "
                    "were given, or the repository does not exist"
                )
            raise Unauthenticated(f"{subject}: {where} refused the credentials (401{detail})")
        if status == 403:
            raise PermissionDenied(f"{subject}: {where} denied access (403{detail})")
        if status == 429:
            raise Unavailable(f"{subject}: {where} is rate limiting pulls (429{detail})")
        if status >= 500:
            raise Unavailable(f"{subject}: {where} failed with {status}{detail}")
        if status == 400:
            raise InvalidArgument(f"{subject}: {where} rejected the request (400{detail})")
        raise Unavailable(f"{subject}: {where} answered {status} unexpectedly{detail}")

    async def _read(self, response: httpx.Response, limit: int, subject: str) -> bytes:
        try:
            data = await read_capped(response, limit)
        except httpx.HTTPError as exc:
            raise Unavailable(describe_connection_error(self.endpoint, exc)) from None
        if data is None:
            raise Unavailable(f"{subject} at {self.endpoint} is larger than {limit} bytes")
        return data

    async def get_manifest(
        self, reference: str, subject: str, expected_digest: str | None = None
    ) -> FetchedManifest:
        """The manifest or index `reference` (a tag or a digest) names. With
        `expected_digest`, content that hashes to anything else is refused."""
        url = self.endpoint.api(f"{self.repository}/manifests/{reference}")
        response = await self._send(url, {"Accept": MANIFEST_ACCEPT}, subject)
        await self._check(response, subject)
        media_type = response.headers.get("content-type", "").split(";")[0].strip()
        data = await self._read(response, MAX_MANIFEST_BYTES, subject)
        algorithm = (expected_digest or "sha256:").partition(":")[0]
        digest = f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"
        if expected_digest is not None and digest != expected_digest:
            raise ContentMismatch(
                f"{subject}: {self.endpoint} sent a manifest that hashes to {digest}, "
                f"not {expected_digest}"
            )
        if media_type in SCHEMA1_TYPES:
            raise FailedPrecondition(
                f"{subject} is a Docker schema 1 image, which cri-shim does not pull "
                "(it was deprecated in 2017); push it again with a current tool"
            )
        return FetchedManifest(data, media_type, digest)

    async def get_blob(self, digest: str, size: int, limit: int, subject: str) -> bytes:
        """A small blob (an image config) in memory, checked against its digest; read no
        further than its descriptor's size."""
        if size > limit:
            raise InvalidArgument(f"{subject}: its descriptor says {size} bytes, over {limit}")
        async with self.open_blob(digest, subject) as response:
            try:
                data = await read_capped(response, size)
            except httpx.HTTPError as exc:
                raise Unavailable(describe_connection_error(self.endpoint, exc)) from None
        if data is None:
            raise ContentMismatch(
                f"{subject}: {self.endpoint} sent more than the {size} bytes of {digest}"
            )
        algorithm = digest.partition(":")[0]
        actual = f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"
        if actual != digest or len(data) != size:
            raise ContentMismatch(
                f"{subject}: {self.endpoint} sent {len(data)} bytes hashing to {actual}, "
                f"expected {digest} ({size} bytes)"
            )
        return data

    @asynccontextmanager
    async def open_blob(self, digest: str, subject: str) -> AsyncIterator[httpx.Response]:
        """The blob's response, status checked, body not read yet. Registries redirect blob
        downloads to storage; httpx follows, dropping our Authorization on another host."""
        url = self.endpoint.api(f"{self.repository}/blobs/{digest}")
        response = await self._send(url, {"Accept-Encoding": "identity"}, subject)
        await self._check(response, subject)
        try:
            yield response
        finally:
            await response.aclose()


def first_error(errors: Sequence[tuple[Endpoint, CriError]]) -> CriError:
    """The error to report after every endpoint failed: the registry's own answer (the
    last endpoint) decides the kind, and what the mirrors said is added to the message."""
    decisive = errors[-1][1]
    if len(errors) == 1:
        return decisive
    others = "; ".join(f"{e}: {exc}" for e, exc in errors[:-1])
    return type(decisive)(f"{decisive} (mirrors tried first: {others})")
