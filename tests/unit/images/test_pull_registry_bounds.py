"""What a registry or token server sends is bounded, and secrets go only where they
belong: token responses are capped as they stream,
descriptors must carry the size that caps a download, a plain-HTTP realm gets nothing
from an HTTPS registry's clients, a redirect to another host gets no credentials or
refresh token, and reprs hide a mirror's password."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from cri_shim.config import config_from_dict
from cri_shim.errors import FailedPrecondition, InvalidArgument, Unavailable
from cri_shim.images.auth import Challenge, Credentials, fetch_token
from cri_shim.images.manifest import parse_manifest
from cri_shim.images.pull import ImagePuller
from cri_shim.images.registry import AuthState, Endpoint, RepositoryClient, endpoints_for
from cri_shim.images.store import ImageStore
from tests.imagebuild import build_image, digest_of
from tests.registry import FakeRegistry, fake_transport

IMAGE = build_image()
REALM = "https://auth.example/token"


# --- sizes -------------------------------------------------------------------------------
async def test_a_token_response_is_read_no_further_than_its_cap() -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1024):  # 64 MiB, never announced
            sent += 1
            yield b" " * 65536

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with pytest.raises(Unavailable, match="over 1048576 bytes"):
            await fetch_token(http, Challenge("bearer", {"realm": REALM}), "s", Credentials())
    assert sent <= 18  # 1 MiB and a chunk, not the 64 the server had


def _without_layer_size(size: object) -> tuple[bytes, str]:
    manifest = json.loads(IMAGE.manifest)
    if size is None:
        del manifest["layers"][0]["size"]
    else:
        manifest["layers"][0]["size"] = size
    data = json.dumps(manifest).encode()
    return data, digest_of(data)


@pytest.mark.parametrize("size", [None, -1])
def test_a_descriptor_without_a_valid_size_is_refused(size: object) -> None:
    data, _ = _without_layer_size(size)
    with pytest.raises(InvalidArgument, match=IMAGE.layers[0].digest):
        parse_manifest(data, "manifest")


@pytest.mark.parametrize("size", [None, -1])
async def test_a_pull_of_a_layer_without_a_size_fetches_nothing(
    store: ImageStore, size: object
) -> None:
    registry = FakeRegistry("reg.test")
    registry.put_image("app", IMAGE, None)
    data, digest = _without_layer_size(size)
    registry.manifests[("app", "v1")] = (IMAGE.manifest_media_type, data)
    registry.manifests[("app", digest)] = (IMAGE.manifest_media_type, data)
    puller = ImagePuller(store, transport=fake_transport(registry))
    try:
        with pytest.raises(InvalidArgument, match="size"):
            await puller.pull("reg.test/app:v1")
    finally:
        await puller.aclose()
    assert registry.gets("blobs") == []


# --- secrets -----------------------------------------------------------------------------
async def test_a_plain_http_realm_of_an_https_registry_gets_no_credentials() -> None:
    registry = FakeRegistry("reg.test")
    registry.put_image("app", IMAGE, "v1")
    token_requests: list[httpx.Request] = []

    def challenge(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.startswith("/token"):
            token_requests.append(request)
            return httpx.Response(200, json={"token": "t"})
        if "authorization" in request.headers:
            return None
        realm = f'Bearer realm="http://{registry.host}/token",service="s"'
        return httpx.Response(401, headers={"WWW-Authenticate": realm})

    registry.fail = challenge
    http = httpx.AsyncClient(transport=fake_transport(registry))
    client = RepositoryClient(
        http, Endpoint("https://reg.test"), "app", Credentials("alice", "pw"), AuthState()
    )
    with pytest.raises(Unavailable, match=r"plain-HTTP realm http://reg\.test/token"):
        await client.get_manifest("v1", "image app:v1")
    assert token_requests == []
    await http.aclose()


async def test_a_token_redirect_to_another_host_carries_no_secret() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "auth.example":
            status = 307 if request.method == "POST" else 302
            return httpx.Response(status, headers={"Location": "https://other.example/token"})
        return httpx.Response(200, json={"token": "from-elsewhere"})

    challenge = Challenge("bearer", {"realm": REALM})
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(handler), follow_redirects=True
    ) as http:
        with pytest.raises(Unavailable, match="another host"):
            await fetch_token(http, challenge, "s", Credentials(identity_token="refresh-secret"))
        token = await fetch_token(http, challenge, "s", Credentials("alice", "pw-secret"))
    assert token.value == "from-elsewhere"
    elsewhere = [r for r in seen if r.url.host == "other.example"]
    assert [r.method for r in elsewhere] == ["GET"]
    assert "authorization" not in elsewhere[0].headers
    assert all(b"refresh-secret" not in r.content for r in elsewhere)


def test_an_endpoints_repr_hides_a_mirrors_password() -> None:
    endpoint = Endpoint("http://user:mirror-secret@mirror.test:5000", mirror=True)
    assert "mirror-secret" not in repr(endpoint)
    assert "mirror-secret" not in repr([endpoint])
    assert "mirror.test:5000" in repr(endpoint)


def test_a_mirrors_password_is_in_no_config_repr_or_message() -> None:
    mirrors = {"docker.io": ["http://user:mirror-secret@mirror.test:5000"]}
    images = config_from_dict({"images": {"mirrors": mirrors}}).images
    assert "mirror-secret" not in repr(images) and "mirror.test:5000" in repr(images)
    for bad in ("http://user:mirror-secret@", "ftp://user:mirror-secret@mirror.test"):
        with pytest.raises(FailedPrecondition) as info:
            endpoints_for("docker.io", mirrors={"docker.io": [bad]})
        assert "mirror-secret" not in str(info.value) and "mirror" in str(info.value)
