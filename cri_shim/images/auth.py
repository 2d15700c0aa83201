"""Registry authentication: the credentials a pull carries, `WWW-Authenticate` challenges,
and bearer tokens (the distribution token protocol, with OAuth2 refresh tokens).

Secrets live only in memory, in `Credentials` and `Token`, whose reprs hide them; nothing
here logs a header, a token or a password, and error messages name the realm, never what
was sent to it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field

import httpx

from cri_shim.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable

log = logging.getLogger(__name__)

# Tokens are refreshed a little before they expire, so none expires in flight.
_EXPIRY_MARGIN = 10.0
# The token spec: a token without `expires_in` is good for 60 seconds.
_DEFAULT_TOKEN_LIFETIME = 60.0
_MAX_TOKEN_RESPONSE = 1 << 20
_MAX_TOKEN_REDIRECTS = 5
CLIENT_ID = "cri-shim"
_BEARER_TOKEN = re.compile(r"^[\x21-\x7e]+$")


@dataclass(frozen=True)
class Credentials:
    """What a PullImage request's `AuthConfig` carries. Anonymous when empty."""

    username: str = ""
    password: str = field(default="", repr=False)
    # An OAuth2 refresh token (docker's "identity token"), exchanged at the token realm.
    identity_token: str = field(default="", repr=False)
    # A bearer token to send to the registry as it is.
    registry_token: str = field(default="", repr=False)

    @classmethod
    def from_auth_config(
        cls,
        username: str = "",
        password: str = "",
        auth: str = "",
        identity_token: str = "",
        registry_token: str = "",
    ) -> Credentials:
        """`auth` is base64 of `user:password` (docker's config.json form); explicit
        username and password win over it."""
        if auth and not (username or password):
            try:
                decoded = base64.b64decode(auth.strip(), validate=True).decode()
            except (ValueError, UnicodeDecodeError):  # binascii.Error; non-ASCII text
                raise InvalidArgument(
                    "auth config: 'auth' is not base64 of 'username:password'"
                ) from None
            username, sep, password = decoded.partition(":")
            if not sep:
                raise InvalidArgument("auth config: 'auth' decodes to no 'username:password'")
        if registry_token and not _BEARER_TOKEN.match(registry_token):
            # Sent as an HTTP header: anything else cannot be encoded, or would add headers.
            raise InvalidArgument(
                "auth config: 'registry_token' is not a bearer token (printable ASCII, no spaces)"
            )
        return cls(username, password, identity_token, registry_token)

    @property
    def anonymous(self) -> bool:
        return not (self.username or self.password or self.identity_token or self.registry_token)

    @property
    def kind(self) -> str:
        """For logs: which kind of credentials these are, never their value."""
        if self.registry_token:
            return "registry token"
        if self.identity_token:
            return "identity token"
        if self.has_basic:
            return "username/password"
        return "anonymous"

    @property
    def has_basic(self) -> bool:
        return bool(self.username or self.password)

    def basic_header(self) -> str:
        pair = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(pair).decode()

    def fingerprint(self) -> str:
        """Tells credentials apart in the token cache without keeping them as a key."""
        material = "\0".join(
            (self.username, self.password, self.identity_token, self.registry_token)
        )
        return hashlib.sha256(material.encode()).hexdigest()


ANONYMOUS = Credentials()


# --- WWW-Authenticate ------------------------------------------------------------------
@dataclass(frozen=True)
class Challenge:
    """One challenge of a `WWW-Authenticate` header (RFC 7235 §2.1); `scheme` is lower
    case and `params` keys are lower case."""

    scheme: str
    params: dict[str, str] = field(default_factory=dict)
    token68: str = ""

    @property
    def realm(self) -> str:
        return self.params.get("realm", "")


_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_SCHEME = re.compile(rf"[\s,]*({_TOKEN})")
_PARAM = re.compile(rf"[ \t]*({_TOKEN})[ \t]*=[ \t]*(?:\"((?:[^\"\\]|\\.)*)\"|({_TOKEN}))[ \t]*")
_TOKEN68 = re.compile(r"[ \t]+([A-Za-z0-9\-._~+/]+=*)[ \t]*(?=,|$)")
_QUOTED_PAIR = re.compile(r"\\(.)")


def parse_www_authenticate(headers: str | list[str]) -> list[Challenge]:
    """Every challenge in one or several `WWW-Authenticate` header values, in order.
    Registries send one (`Bearer realm=…,service=…,scope=…`), but a header may carry
    several (`Basic realm="a", Bearer realm="b"`) and a comma also separates parameters,
    so a comma starts a new challenge only when what follows is not `name=value`."""
    values = [headers] if isinstance(headers, str) else headers
    challenges: list[Challenge] = []
    for header in values:
        pos = 0
        while (scheme := _SCHEME.match(header, pos)) is not None:
            pos = scheme.end()
            params: dict[str, str] = {}
            token68 = ""
            single = _TOKEN68.match(header, pos)
            if single is not None and _PARAM.match(header, pos) is None:
                token68, pos = single.group(1), single.end()
            else:
                while (param := _PARAM.match(header, pos)) is not None:
                    quoted, bare = param.group(2), param.group(3)
                    value = _QUOTED_PAIR.sub(r"\1", quoted) if quoted is not None else bare
                    params[param.group(1).lower()] = value
                    pos = param.end()
                    if header.startswith(",", pos) and _PARAM.match(header, pos + 1):
                        pos += 1
                        continue
                    break
            challenges.append(Challenge(scheme.group(1).lower(), params, token68))
            # Skip anything unparseable up to the next comma rather than loop on it.
            while pos < len(header) and header[pos] in " \t":
                pos += 1
            if pos < len(header) and header[pos] != ",":
                comma = header.find(",", pos)
                pos = len(header) if comma < 0 else comma
    return challenges


# --- bearer tokens -----------------------------------------------------------------------
@dataclass(frozen=True)
class Token:
    value: str = field(repr=False)
    expires_at: float  # time.monotonic()

    @property
    def fresh(self) -> bool:
        return time.monotonic() < self.expires_at - _EXPIRY_MARGIN


@dataclass
class TokenCache:
    """Tokens by (realm, service, scope, credentials), so that pulls from one repository
    with the same credentials share a token until it expires."""

    _tokens: dict[tuple[str, str, str, str], Token] = field(default_factory=dict)

    def get(self, key: tuple[str, str, str, str]) -> Token | None:
        token = self._tokens.get(key)
        if token is not None and not token.fresh:
            del self._tokens[key]
            return None
        return token

    def put(self, key: tuple[str, str, str, str], token: Token) -> None:
        self._tokens[key] = token

    def __len__(self) -> int:
        return len(self._tokens)


async def read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """A streamed response's body, or None as soon as it passes `limit` bytes: a body is
    never held beyond the limit, whatever its Content-Length says. Closes the response."""
    chunks: list[bytes] = []
    total = 0
    try:
        async for chunk in response.aiter_bytes():
            total += len(chunk)
            if total > limit:
                return None
            chunks.append(chunk)
    finally:
        await response.aclose()
    return b"".join(chunks)


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}"


async def _send_token_request(
    http: httpx.AsyncClient, request: httpx.Request, realm: str
) -> httpx.Response:
    """Send a token request, following redirects here rather than in httpx: httpx drops
    the Authorization header on another host but sends a 307's POST body, the refresh
    token, wherever it points. A redirect to another origin gets no basic credentials, a
    refresh-token grant is not sent there at all, and nothing leaves HTTPS."""
    for _hop in range(_MAX_TOKEN_REDIRECTS + 1):
        response = await http.send(request, stream=True, follow_redirects=False)
        location = response.headers.get("location")
        if not response.is_redirect or location is None:
            return response
        await response.aclose()
        target = request.url.join(location)
        if request.url.scheme == "https" and target.scheme != "https":
            raise Unavailable(f"token server {realm} redirected to plain HTTP ({_origin(target)})")
        headers = httpx.Headers(request.headers)
        headers.pop("host", None)
        if _origin(target) != _origin(request.url):
            if request.method == "POST":
                raise Unavailable(
                    f"token server {realm} redirected the refresh-token grant to another "
                    f"host ({_origin(target)}); it is not sent there"
                )
            headers.pop("authorization", None)
        if request.method == "POST" and response.status_code in (307, 308):
            request = http.build_request("POST", target, headers=headers, content=request.content)
        else:
            headers.pop("content-type", None)
            headers.pop("content-length", None)
            request = http.build_request("GET", target, headers=headers)
    raise Unavailable(f"token server {realm} redirected more than {_MAX_TOKEN_REDIRECTS} times")


def repository_scope(repository: str, actions: str = "pull") -> str:
    return f"repository:{repository}:{actions}"


async def fetch_token(
    http: httpx.AsyncClient,
    challenge: Challenge,
    scope: str,
    credentials: Credentials,
    registry_url: str = "",
) -> Token:
    """A token from the challenge's realm for `scope`: with an identity token, the OAuth2
    refresh-token grant (POST); otherwise GET, with basic credentials when there are any,
    anonymously when not (public repositories on Docker Hub work that way).

    `registry_url` is the endpoint that sent the challenge: an `https` one may not send
    its clients' credentials to a plain-HTTP realm."""
    realm = challenge.realm
    if not realm.startswith(("https://", "http://")):
        raise Unavailable(f"registry sent a bearer challenge with an unusable realm {realm!r}")
    if registry_url.startswith("https://") and realm.startswith("http://"):
        raise Unavailable(
            f"registry {_origin(httpx.URL(registry_url))} sent a bearer challenge with the "
            f"plain-HTTP realm {realm}: refused, credentials are sent to a realm only over "
            "HTTPS when the registry uses it"
        )
    service = challenge.params.get("service", "")
    try:
        if credentials.identity_token:
            form = {
                "grant_type": "refresh_token",
                "refresh_token": credentials.identity_token,
                "client_id": CLIENT_ID,
                "scope": scope,
            }
            if service:
                form["service"] = service
            request = http.build_request("POST", realm, data=form)
        else:
            query = {"scope": scope}
            if service:
                query["service"] = service
            headers = {"Authorization": credentials.basic_header()} if credentials.has_basic else {}
            request = http.build_request("GET", realm, params=query, headers=headers)
        response = await _send_token_request(http, request, realm)
        # Streamed: the size is checked as the body comes, not after it is all in memory.
        content = await read_capped(response, _MAX_TOKEN_RESPONSE)
    except httpx.HTTPError as exc:
        raise Unavailable(
            f"token server {realm} is unreachable: {type(exc).__name__}: {exc}"
        ) from None
    if response.status_code == 401:
        raise Unauthenticated(
            f"token server {realm} refused the credentials for {scope} (401)"
            if not credentials.anonymous
            else f"token server {realm} requires credentials for {scope} (401)"
        )
    if response.status_code == 403:
        raise PermissionDenied(f"token server {realm} denied {scope} (403)")
    if response.status_code != 200:
        raise Unavailable(f"token server {realm} answered {response.status_code} for {scope}")
    if content is None:
        raise Unavailable(f"token server {realm} sent a response over {_MAX_TOKEN_RESPONSE} bytes")
    try:
        body = json.loads(content)
    except ValueError:
        raise Unavailable(f"token server {realm} sent a response that is not JSON") from None
    if not isinstance(body, dict):
        raise Unavailable(f"token server {realm} sent a response that is not a JSON object")
    # `token` per the distribution spec, `access_token` per OAuth2; servers send either.
    value = body.get("token") or body.get("access_token")
    if not isinstance(value, str) or not value:
        raise Unavailable(f"token server {realm} sent no token")
    lifetime = body.get("expires_in")
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = _DEFAULT_TOKEN_LIFETIME
    log.debug("token for %s from %s, valid %ss", scope, realm, lifetime)
    return Token(value, time.monotonic() + float(lifetime))
