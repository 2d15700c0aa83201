"""Registry credentials never leave the pull that carried them: after pulls with
credentials in every AuthConfig form, good and bad, against docker-registry with basic
auth and against an unreachable registry, no secret is in the daemon's log (at debug
level), in any file under its state and runtime roots (state.db and its WAL included),
in any error's details, or in the verbose info of any status RPC."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon
from tests.imagebuild import build_image
from tests.registry import RegistryServer, start_registry

pytestmark = [pytest.mark.integration, pytest.mark.root]

PASSWORD = "pw-Hx91-hardening-never-logged"
WRONG = "wrong-Qe52-hardening-never-logged"
IDENTITY = "identity-Lp07-hardening-never-logged"
REGISTRY_TOKEN = "regtoken-Vb33-hardening-never-logged"
SECRETS = [
    PASSWORD,
    WRONG,
    IDENTITY,
    REGISTRY_TOKEN,
    base64.b64encode(f"alice:{PASSWORD}".encode()).decode(),
    base64.b64encode(f"alice:{WRONG}".encode()).decode(),
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = start_registry(tmp_path_factory.mktemp("secrets"), "basic", {"alice": PASSWORD})
    server.push("private/app", build_image(extra_files={"etc/which": b"secret"}), "v1")
    yield server
    server.stop()


@pytest.fixture
def daemon(short_tmp: Path, registry: RegistryServer) -> Iterator[Daemon]:
    d = Daemon(short_tmp, None, settings={"images": {"insecure_registries": [registry.host]}})
    d.start()
    yield d
    d.stop()


def pull(daemon: Daemon, image: str, **auth: str) -> tuple[grpc.StatusCode, str, str]:
    request = api_pb2.PullImageRequest(
        image=api_pb2.ImageSpec(image=image), auth=api_pb2.AuthConfig(**auth)
    )
    try:
        ref = daemon.images().PullImage(request, timeout=60).image_ref
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", ""
    return grpc.StatusCode.OK, "", ref


def verbose_infos(daemon: Daemon, image: str) -> list[str]:
    runtime, images = daemon.runtime(), daemon.images()
    status = images.ImageStatus(
        api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=image), verbose=True), timeout=10
    )
    infos = [*status.info.values(), str(status.image)]
    infos += runtime.Status(api_pb2.StatusRequest(verbose=True), timeout=10).info.values()
    infos.append(str(images.ListImages(api_pb2.ListImagesRequest(), timeout=10)))
    return infos


def files_under(*roots: Path) -> Iterator[tuple[Path, bytes]]:
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink() and not path.is_socket():
                yield path, path.read_bytes()


def test_credentials_never_reach_logs_state_errors_or_verbose_info(
    daemon: Daemon, registry: RegistryServer
) -> None:
    image = f"{registry.host}/private/app:v1"
    encoded = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    details: list[str] = []

    code, detail, ref = pull(daemon, image, username="alice", password=PASSWORD)
    assert code == grpc.StatusCode.OK and ref.startswith("sha256:"), detail
    daemon.images().RemoveImage(
        api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=image)), timeout=30
    )
    code, detail, _ = pull(daemon, image, auth=encoded)
    assert code == grpc.StatusCode.OK, detail
    for auth in (
        {"username": "alice", "password": WRONG},
        {"auth": base64.b64encode(f"alice:{WRONG}".encode()).decode()},
        {"registry_token": REGISTRY_TOKEN},
        {"identity_token": IDENTITY},
    ):
        # Pulled again (the image is there, but a pull always proves the caller's access).
        code, detail, _ = pull(daemon, image, **auth)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (auth.keys(), code, detail)
        details.append(detail)
    # Unreachable: the connection error is reported, the credentials are not.
    code, detail, _ = pull(daemon, "127.0.0.1:1/private/app:v1", username="alice", password=WRONG)
    assert code == grpc.StatusCode.UNAVAILABLE, detail
    details.append(detail)
    # Not base64: refused, without echoing it.
    code, detail, _ = pull(daemon, image, auth=f"{WRONG}!!")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, detail
    details.append(detail)

    places: dict[str, bytes] = {f"error {i}": d.encode() for i, d in enumerate(details)}
    places.update(
        {f"verbose info {i}": info.encode() for i, info in enumerate(verbose_infos(daemon, image))}
    )
    daemon.stop()  # flushes the log and checkpoints the database
    log = daemon.log_path.read_bytes()
    assert b"PullImage" in log and b"username/password" in log  # the log was written
    places["the daemon log"] = log
    places.update({str(p): data for p, data in files_under(daemon.root, daemon.run_root)})
    assert any(name.endswith("state.db") for name in places)
    for where, data in places.items():
        for secret in SECRETS:
            assert secret.encode() not in data, f"a secret is in {where}"
    assert b"Basic " not in log and b"Authorization" not in log
