"""Registry authentication: WWW-Authenticate parsing, credentials from AuthConfig, tokens."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from cri_shim.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from cri_shim.images.auth import (
    Challenge,
    Credentials,
    Token,
    TokenCache,
    fetch_token,
    parse_www_authenticate,
    repository_scope,
)


# --- WWW-Authenticate --------------------------------------------------------------------
def test_docker_hub_bearer_challenge() -> None:
    header = (
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/busybox:pull"'
    )
    [challenge] = parse_www_authenticate(header)
    assert challenge.scheme == "bearer"
    assert challenge.realm == "https://auth.docker.io/token"
    assert challenge.params == {
        "realm": "https://auth.docker.io/token",
        "service": "registry.docker.io",
        "scope": "repository:library/busybox:pull",
    }


def test_basic_challenge_and_case_insensitive_names() -> None:
    [challenge] = parse_www_authenticate('BASIC Realm="Registry Realm"')
    assert challenge == Challenge("basic", {"realm": "Registry Realm"})


def test_several_challenges_in_one_header_and_across_headers() -> None:
    header = (
        'Basic realm="a", Bearer realm="https://t/token", service="s", error="insufficient_scope"'
    )
    challenges = parse_www_authenticate([header, "Negotiate abc123=="])
    assert [c.scheme for c in challenges] == ["basic", "bearer", "negotiate"]
    assert challenges[0].params == {"realm": "a"}
    assert challenges[1].params == {
        "realm": "https://t/token",
        "service": "s",
        "error": "insufficient_scope",
    }
    assert challenges[2].token68 == "abc123=="


def test_scope_with_several_repositories_and_escaped_quotes() -> None:
    header = (
        'Bearer realm="https://t/token",scope="repository:a/b:pull repository:c:pull,push",'
        'error_description="say \\"hi\\""'
    )
    [challenge] = parse_www_authenticate(header)
    assert challenge.params["scope"] == "repository:a/b:pull repository:c:pull,push"
    assert challenge.params["error_description"] == 'say "hi"'


def test_unquoted_params_spaces_and_garbage() -> None:
    [challenge] = parse_www_authenticate('Bearer  realm = "https://t/token" , service=reg')
    assert challenge.params == {"realm": "https://t/token", "service": "reg"}
    assert parse_www_authenticate("") == []
    # Nothing parseable after the scheme: still a challenge, and no endless loop.
    assert [c.scheme for c in parse_www_authenticate('Bearer "oops", Basic realm="x"')] == [
        "bearer",
        "basic",
    ]


# --- credentials -------------------------------------------------------------------------
def test_credentials_from_auth_field_and_explicit_fields() -> None:
    auth = base64.b64encode(b"alice:s3cr:et").decode()
    creds = Credentials.from_auth_config(auth=auth)
    assert (creds.username, creds.password) == ("alice", "s3cr:et")
    explicit = Credentials.from_auth_config(username="bob", password="pw", auth=auth)
    assert (explicit.username, explicit.password) == ("bob", "pw")
    assert Credentials.from_auth_config().anonymous
    assert Credentials.from_auth_config().kind == "anonymous"
    assert creds.kind == "username/password"
    assert not Credentials.from_auth_config(registry_token="t").anonymous


def test_bad_auth_field_is_invalid_argument_without_echoing_it() -> None:
    with pytest.raises(InvalidArgument) as info:
        Credentials.from_auth_config(auth="not base64 at all!!")
    assert "not base64" in str(info.value) and "at all" not in str(info.value)
    with pytest.raises(InvalidArgument):
        Credentials.from_auth_config(auth=base64.b64encode(b"no-colon").decode())


def test_secrets_never_in_repr() -> None:
    creds = Credentials("alice", "hunter2", "idtok", "regtok")
    text = repr(creds) + str(creds)
    assert "alice" in text
    for secret in ("hunter2", "idtok", "regtok"):
        assert secret not in text
    assert "tokvalue" not in repr(Token("tokvalue", 0.0))
    assert Credentials("a", "b").fingerprint() != Credentials("a", "c").fingerprint()


# --- tokens ------------------------------------------------------------------------------
def _client(handler: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


async def test_fetch_token_with_basic_credentials() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"token": "T1", "expires_in": 120})

    challenge = Challenge("bearer", {"realm": "https://auth.example/token", "service": "reg"})
    async with _client(handler) as http:
        token = await fetch_token(http, challenge, repository_scope("a/b"), Credentials("u", "p"))
    assert token.value == "T1" and token.fresh
    assert 100 < token.expires_at - time.monotonic() <= 120
    [request] = seen
    assert request.method == "GET"
    assert request.url.params["scope"] == "repository:a/b:pull"
    assert request.url.params["service"] == "reg"
    assert request.headers["authorization"] == "Basic " + base64.b64encode(b"u:p").decode()


async def test_fetch_token_anonymous_sends_no_authorization_and_defaults_lifetime() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert "authorization" not in request.headers
        return httpx.Response(200, json={"access_token": "anon"})

    challenge = Challenge("bearer", {"realm": "https://auth.example/token"})
    async with _client(handler) as http:
        token = await fetch_token(http, challenge, "repository:x:pull", Credentials())
    assert token.value == "anon"
    assert 50 < token.expires_at - time.monotonic() <= 60


async def test_identity_token_uses_the_oauth2_refresh_grant() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "POST"
        form = dict(item.split("=", 1) for item in request.content.decode().split("&"))
        assert form["grant_type"] == "refresh_token"
        assert form["refresh_token"] == "refresh-me"
        assert form["service"] == "reg"
        return httpx.Response(200, json={"access_token": "A", "expires_in": 300})

    challenge = Challenge("bearer", {"realm": "https://auth.example/token", "service": "reg"})
    async with _client(handler) as http:
        token = await fetch_token(
            http, challenge, "repository:x:pull", Credentials(identity_token="refresh-me")
        )
    assert token.value == "A"


@pytest.mark.parametrize(
    ("status", "error"), [(401, Unauthenticated), (403, PermissionDenied), (500, Unavailable)]
)
async def test_token_server_refusals(status: int, error: type[Exception]) -> None:
    challenge = Challenge("bearer", {"realm": "https://auth.example/token"})
    async with _client(lambda request: httpx.Response(status)) as http:
        with pytest.raises(error) as info:
            await fetch_token(http, challenge, "repository:x:pull", Credentials("u", "pw-secret"))
    assert "https://auth.example/token" in str(info.value)
    assert "pw-secret" not in str(info.value)


async def test_unreachable_token_server_and_bad_realm() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with _client(handler) as http:
        with pytest.raises(Unavailable, match=r"auth\.example"):
            await fetch_token(
                http, Challenge("bearer", {"realm": "https://auth.example/t"}), "s", Credentials()
            )
        with pytest.raises(Unavailable, match="unusable realm"):
            await fetch_token(http, Challenge("bearer", {"realm": "ftp://x"}), "s", Credentials())


def test_token_cache_drops_expired_tokens() -> None:
    cache = TokenCache()
    key = ("realm", "svc", "scope", "fp")
    cache.put(key, Token("fresh", time.monotonic() + 300))
    assert cache.get(key) is not None
    cache.put(key, Token("stale", time.monotonic() + 5))  # inside the refresh margin
    assert cache.get(key) is None
    assert len(cache) == 0
