"""The registry client: endpoints and mirror order, the auth handshake, error mapping."""

from __future__ import annotations

import httpx
import pytest

from cri_shim.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from cri_shim.images.auth import ANONYMOUS, Credentials
from cri_shim.images.registry import (
    MANIFEST_ACCEPT,
    AuthState,
    ContentMismatch,
    Endpoint,
    RepositoryClient,
    endpoints_for,
    first_error,
    is_insecure,
)
from tests.imagebuild import build_image
from tests.registry import FakeRegistry, fake_transport


# --- endpoints ---------------------------------------------------------------------------
def test_docker_hub_goes_to_registry_1_over_https() -> None:
    assert endpoints_for("docker.io") == [Endpoint("https://registry-1.docker.io")]
    assert endpoints_for("quay.io") == [Endpoint("https://quay.io")]


def test_mirrors_come_first_in_configured_order() -> None:
    mirrors = {
        "docker.io": ["http://127.0.0.1:5000", "https://mirror.example/v2/", "m2.example:8443"],
        "quay.io": ["http://elsewhere"],
    }
    assert endpoints_for("docker.io", [], mirrors) == [
        Endpoint("http://127.0.0.1:5000", mirror=True),
        Endpoint("https://mirror.example", mirror=True),
        Endpoint("https://m2.example:8443", mirror=True),
        Endpoint("https://registry-1.docker.io"),
    ]


def test_docker_hub_mirrors_under_its_other_names() -> None:
    for key in ("index.docker.io", "registry-1.docker.io"):
        endpoints = endpoints_for("docker.io", [], {key: ["http://m"]})
        assert endpoints == [
            Endpoint("http://m", mirror=True),
            Endpoint("https://registry-1.docker.io"),
        ]
    assert endpoints_for("quay.io", [], {"index.docker.io": ["http://m"]}) == [
        Endpoint("https://quay.io")
    ]


def test_plain_http_only_for_insecure_registries() -> None:
    insecure = ["127.0.0.1:5000", "plain.example"]
    assert endpoints_for("127.0.0.1:5000", insecure) == [Endpoint("http://127.0.0.1:5000")]
    assert endpoints_for("127.0.0.1:5001", insecure) == [Endpoint("https://127.0.0.1:5001")]
    # A bare host name in the list covers every port.
    assert endpoints_for("plain.example:8080", insecure) == [Endpoint("http://plain.example:8080")]
    # A mirror without a scheme is plain HTTP only when its host is insecure.
    mirrors = {"quay.io": ["127.0.0.1:5000", "other:5000"]}
    assert [e.url for e in endpoints_for("quay.io", insecure, mirrors)] == [
        "http://127.0.0.1:5000",
        "https://other:5000",
        "https://quay.io",
    ]
    assert is_insecure("host:1", ["http://host:1/"])
    assert not is_insecure("host:1", ["host:2"])


def test_a_mirror_that_is_the_registry_is_tried_once() -> None:
    insecure = ["127.0.0.1:5000"]
    mirrors = {"127.0.0.1:5000": ["http://127.0.0.1:5000"]}
    assert endpoints_for("127.0.0.1:5000", insecure, mirrors) == [Endpoint("http://127.0.0.1:5000")]


def test_bad_mirror_is_a_configuration_error_naming_the_key() -> None:
    with pytest.raises(FailedPrecondition, match=r"images\.mirrors\.docker\.io"):
        endpoints_for("docker.io", [], {"docker.io": ["ftp://mirror"]})


def test_endpoint_hides_userinfo() -> None:
    endpoint = Endpoint("https://user:pw@mirror.example")
    assert "pw" not in str(endpoint) and "mirror.example" in str(endpoint)


def test_first_error_takes_the_registry_kind_and_lists_the_mirrors() -> None:
    mirror, own = Endpoint("http://m", mirror=True), Endpoint("https://r")
    error = first_error([(mirror, Unavailable("m is down")), (own, NotFound("no such tag"))])
    assert isinstance(error, NotFound)
    assert "no such tag" in str(error) and "m is down" in str(error)


# --- one repository at one endpoint ----------------------------------------------------
IMAGE = build_image()


def _client(
    registry: FakeRegistry,
    credentials: Credentials = ANONYMOUS,
    state: AuthState | None = None,
    repository: str = "app",
) -> RepositoryClient:
    http = httpx.AsyncClient(transport=fake_transport(registry))
    return RepositoryClient(
        http, Endpoint(f"https://{registry.host}"), repository, credentials, state or AuthState()
    )


async def test_manifest_by_tag_and_digest_with_accept_header() -> None:
    registry = FakeRegistry("reg.test")
    registry.put_image("app", IMAGE, "v1")
    accepts: list[str] = []

    def record(request: httpx.Request) -> httpx.Response | None:
        accepts.append(request.headers.get("accept", ""))
        return None

    registry.fail = record
    client = _client(registry)
    by_tag = await client.get_manifest("v1", "image app:v1")
    assert by_tag.digest == IMAGE.manifest_digest and by_tag.data == IMAGE.manifest
    assert by_tag.media_type == IMAGE.manifest_media_type
    by_digest = await client.get_manifest(IMAGE.manifest_digest, "x", IMAGE.manifest_digest)
    assert by_digest.digest == IMAGE.manifest_digest
    assert accepts == [MANIFEST_ACCEPT, MANIFEST_ACCEPT]
    for media_type in (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ):
        assert media_type in MANIFEST_ACCEPT


async def test_manifest_that_does_not_match_its_digest_is_refused() -> None:
    registry = FakeRegistry("reg.test")
    registry.put_image("app", IMAGE, "v1")
    other = build_image(compression="none")
    registry.manifests[("app", other.manifest_digest)] = ("x", IMAGE.manifest)
    with pytest.raises(ContentMismatch, match="hashes to"):
        await _client(registry).get_manifest(other.manifest_digest, "x", other.manifest_digest)


async def test_schema1_is_refused_with_a_reason() -> None:
    registry = FakeRegistry("reg.test")
    registry.manifests[("app", "old")] = (
        "application/vnd.docker.distribution.manifest.v1+prettyjws",
        b"{}",
    )
    with pytest.raises(FailedPrecondition, match="schema 1"):
        await _client(registry).get_manifest("old", "image app:old")


@pytest.mark.parametrize(
    ("status", "error", "text"),
    [
        (404, NotFound, "not found at https://reg.test"),
        (403, PermissionDenied, "denied"),
        (429, Unavailable, "rate limiting"),
        (503, Unavailable, "failed with 503"),
        (400, InvalidArgument, "rejected"),
    ],
)
async def test_status_codes_map_to_domain_errors(
    status: int, error: type[Exception], text: str
) -> None:
    registry = FakeRegistry("reg.test")
    registry.fail = lambda request: httpx.Response(
        status, json={"errors": [{"code": "SOME_CODE", "message": "registry says so"}]}
    )
    with pytest.raises(error) as info:
        await _client(registry).get_manifest("v1", "image reg.test/app:v1")
    message = str(info.value)
    assert "image reg.test/app:v1" in message and text in message
    assert "SOME_CODE: registry says so" in message


async def test_unreachable_endpoint_is_unavailable_naming_it() -> None:
    registry = FakeRegistry("reg.test", down=True)
    with pytest.raises(Unavailable, match=r"registry endpoint https://reg\.test is unreachable"):
        await _client(registry).get_manifest("v1", "image app:v1")


async def test_basic_auth_handshake() -> None:
    registry = FakeRegistry("reg.test", auth="basic", users={"alice": "pw"})
    registry.put_image("app", IMAGE, "v1")
    client = _client(registry, Credentials("alice", "pw"))
    assert (await client.get_manifest("v1", "x")).digest == IMAGE.manifest_digest
    # 401 first, then the retry with credentials; later requests send them up front.
    await client.get_blob(IMAGE.config_digest, len(IMAGE.config), 1 << 20, "config")
    assert registry.requests == [
        "GET /v2/app/manifests/v1",
        "GET /v2/app/manifests/v1",
        f"GET /v2/app/blobs/{IMAGE.config_digest}",
    ]
    with pytest.raises(Unauthenticated, match="refused the credentials"):
        await _client(registry, Credentials("alice", "wrong")).get_manifest("v1", "x")
    with pytest.raises(Unauthenticated, match="requires credentials and none were given"):
        await _client(registry).get_manifest("v1", "x")


async def test_bearer_handshake_shares_tokens_between_clients() -> None:
    registry = FakeRegistry("reg.test", auth="token", users={"alice": "pw"})
    registry.put_image("app", IMAGE, "v1")
    state = AuthState()
    first = _client(registry, Credentials("alice", "pw"), state)
    await first.get_manifest("v1", "x")
    assert registry.requests == [
        "GET /v2/app/manifests/v1",
        "GET token",
        "GET /v2/app/manifests/v1",
    ]
    registry.requests.clear()
    # A second client of the same endpoint authorises up front with the cached token.
    second = _client(registry, Credentials("alice", "pw"), state)
    await second.get_manifest("v1", "x")
    assert registry.requests == ["GET /v2/app/manifests/v1"]
    with pytest.raises(Unauthenticated, match="refused the credentials"):
        await _client(registry, Credentials("alice", "bad")).get_manifest("v1", "x")


async def test_registry_token_is_sent_as_is() -> None:
    registry = FakeRegistry("reg.test", auth="token")
    registry.put_image("app", IMAGE, "v1")
    client = _client(registry, Credentials(registry_token="tok-given"))
    await client.get_manifest("v1", "x")
    assert registry.requests == ["GET /v2/app/manifests/v1"]
    with pytest.raises(Unauthenticated, match="refused the registry token"):
        await _client(registry, Credentials(registry_token="nope")).get_manifest("v1", "x")


async def test_identity_token_is_exchanged() -> None:
    registry = FakeRegistry("reg.test", auth="token")
    registry.put_image("app", IMAGE, "v1")
    client = _client(registry, Credentials(identity_token="refresh-ok"))
    assert (await client.get_manifest("v1", "x")).digest == IMAGE.manifest_digest
    assert "POST token" in registry.requests


async def test_blob_is_checked_against_digest_and_size() -> None:
    registry = FakeRegistry("reg.test")
    registry.put_image("app", IMAGE, "v1")
    registry.blobs[IMAGE.config_digest] = IMAGE.config + b" "
    with pytest.raises(ContentMismatch):
        await _client(registry).get_blob(IMAGE.config_digest, len(IMAGE.config), 1 << 20, "c")
