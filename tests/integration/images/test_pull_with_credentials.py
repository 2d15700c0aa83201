"""PullImage with credentials against docker-registry's own auth: htpasswd (basic) and token
auth with a token server of the test's own (tests/registry.py). Credentials must work
in every form AuthConfig carries them, and never show up in logs, errors or state."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon
from tests.imagebuild import build_image
from tests.registry import TOKEN_SERVICE, RegistryServer, start_registry

pytestmark = [pytest.mark.integration, pytest.mark.root]

PASSWORD = "pw-Zq81-never-logged"
WRONG = "wrong-Xk2-never-logged"
REFRESH = "refresh-Mm3-never-logged"


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = start_registry(tmp_path_factory.mktemp("basic"), "basic", {"alice": PASSWORD})
    server.push("private/app", build_image(extra_files={"etc/which": b"basic"}), "v1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = start_registry(
        tmp_path_factory.mktemp("token"), "token", {"alice": PASSWORD, "bob": PASSWORD}
    )
    assert server.token_server is not None
    server.token_server.readable["alice"] = {"private/app"}
    server.token_server.public = {"public/app"}
    server.token_server.refresh_tokens[REFRESH] = "alice"
    server.push("private/app", build_image(extra_files={"etc/which": b"token"}), "v1")
    server.push("public/app", build_image(extra_files={"etc/which": b"public"}), "v1")
    yield server
    server.stop()


@pytest.fixture
def daemon(
    short_tmp: Path, basic_registry: RegistryServer, token_registry: RegistryServer
) -> Iterator[Daemon]:
    hosts = [basic_registry.host, token_registry.host]
    d = Daemon(short_tmp, None, settings={"images": {"insecure_registries": hosts}})
    d.start()
    yield d
    d.stop()
    assert_no_secrets(d)


def assert_no_secrets(daemon: Daemon) -> None:
    """Not in the daemon's log (debug level), not in the state database."""
    secrets = [PASSWORD, WRONG, REFRESH, base64.b64encode(f"alice:{PASSWORD}".encode()).decode()]
    places = {"the log": daemon.log_path.read_bytes()}
    places.update({path.name: path.read_bytes() for path in daemon.root.glob("state.db*")})
    for where, data in places.items():
        for secret in secrets:
            assert secret.encode() not in data, f"a secret is in {where}"
    assert b"Bearer eyJ" not in places["the log"], "a token is in the log"


def pull(daemon: Daemon, image: str, **auth: str) -> str:
    request = api_pb2.PullImageRequest(
        image=api_pb2.ImageSpec(image=image), auth=api_pb2.AuthConfig(**auth)
    )
    return str(daemon.images().PullImage(request, timeout=60).image_ref)


def pull_error(daemon: Daemon, image: str, **auth: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        pull(daemon, image, **auth)
    for secret in (PASSWORD, WRONG, REFRESH):
        assert secret not in info.value.details()
    return info.value


# --- basic auth (htpasswd) ---------------------------------------------------------------
def test_basic_auth_good_credentials(daemon: Daemon, basic_registry: RegistryServer) -> None:
    ref = f"{basic_registry.host}/private/app:v1"
    assert pull(daemon, ref, username="alice", password=PASSWORD).startswith("sha256:")
    # The `auth` field (base64 of user:password, as in docker's config.json) works too.
    encoded = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    daemon.images().RemoveImage(
        api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=ref)), timeout=30
    )
    assert pull(daemon, ref, auth=encoded).startswith("sha256:")


def test_basic_auth_bad_or_missing_credentials(
    daemon: Daemon, basic_registry: RegistryServer
) -> None:
    ref = f"{basic_registry.host}/private/app:v1"
    error = pull_error(daemon, ref, username="alice", password=WRONG)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"http://{basic_registry.host}" in error.details()
    assert "refused the credentials" in error.details()
    error = pull_error(daemon, ref)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "requires credentials and none were given" in error.details()


# --- token auth ------------------------------------------------------------------------------
def test_bearer_token_with_username_and_password(
    daemon: Daemon, token_registry: RegistryServer
) -> None:
    assert token_registry.token_server is not None
    token_registry.token_server.requests.clear()
    ref = f"{token_registry.host}/private/app:v1"
    assert pull(daemon, ref, username="alice", password=PASSWORD).startswith("sha256:")
    # One token for the manifest and every blob of the pull.
    assert token_registry.token_server.requests == ["GET /token"]


def test_bearer_token_bad_credentials_and_no_access(
    daemon: Daemon, token_registry: RegistryServer
) -> None:
    ref = f"{token_registry.host}/private/app:v1"
    error = pull_error(daemon, ref, username="alice", password=WRONG)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert token_registry.token_server is not None
    assert token_registry.token_server.realm in error.details()
    # bob exists but may not read the repository: the registry says insufficient_scope.
    error = pull_error(daemon, ref, username="bob", password=PASSWORD)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert "private/app" in error.details()
    # Anonymous: the token server grants nothing for a private repository.
    error = pull_error(daemon, ref)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_bearer_token_anonymous_public_repository(
    daemon: Daemon, token_registry: RegistryServer
) -> None:
    assert pull(daemon, f"{token_registry.host}/public/app:v1").startswith("sha256:")


def test_identity_token_and_registry_token(daemon: Daemon, token_registry: RegistryServer) -> None:
    ref = f"{token_registry.host}/private/app:v1"
    assert token_registry.token_server is not None
    token_registry.token_server.requests.clear()
    assert pull(daemon, ref, identity_token=REFRESH).startswith("sha256:")
    assert token_registry.token_server.requests == ["POST /token"]

    daemon.images().RemoveImage(
        api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=ref)), timeout=30
    )
    token = httpx.get(
        token_registry.token_server.realm,
        params={"service": TOKEN_SERVICE, "scope": "repository:private/app:pull"},
        auth=("alice", PASSWORD),
    ).json()["token"]
    token_registry.token_server.requests.clear()
    assert pull(daemon, ref, registry_token=token).startswith("sha256:")
    assert token_registry.token_server.requests == []  # sent to the registry as it is
    assert token.encode() not in daemon.log_path.read_bytes()
