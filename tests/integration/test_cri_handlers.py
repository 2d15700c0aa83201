"""Several runtime handlers from the configuration, each reported in Status with its real
features; UpdatePodSandboxResources and UpdateRuntimeConfig.

crun 1.8 is configured to show that features are probed per binary, but containers run
under a second runc handler: crun refuses this host's hybrid cgroup layout (a controller
is enabled in the v2 hierarchy), which is the host's limit, not the daemon's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, userns_linux
from tests.integration.cri_testkit import (
    container_config,
    create,
    import_image,
    pod,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]


@pytest.fixture
def two_handlers(make_daemon: Any, busybox_layout: Path) -> Iterator[Daemon]:
    if shutil.which("crun") is None:
        pytest.skip("crun is not installed")
    handlers = {"runc": {"path": "runc"}, "crun": {"path": "crun"}, "second": {"path": "runc"}}
    daemon: Daemon = make_daemon(settings={"runtime": {"handlers": handlers}})
    daemon.start()
    import_image(daemon, busybox_layout)
    yield daemon


def test_each_handler_is_reported_with_its_own_features(two_handlers: Daemon) -> None:
    response = two_handlers.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    features = {h.name: h.features for h in response.runtime_handlers}
    # The default handler (runc) is listed under "" too: clients look it up there.
    assert sorted(features) == ["", "crun", "runc", "second"]
    assert features[""] == features["runc"]
    # runc 1.1 lists "rro" in `runc features`; crun 1.8 has no such command.
    assert features["runc"].recursive_read_only_mounts
    assert features["second"].recursive_read_only_mounts
    assert not features["crun"].recursive_read_only_mounts
    # runc lists the user namespace in `runc features` and the kernel idmaps tmpfs.
    assert features["runc"].user_namespaces
    assert not features["crun"].user_namespaces


def test_the_empty_name_is_the_configured_default_handler(make_daemon: Any) -> None:
    if shutil.which("crun") is None:
        pytest.skip("crun is not installed")
    handlers = {"runc": {"path": "runc"}, "crun": {"path": "crun"}}
    daemon: Daemon = make_daemon(
        settings={"runtime": {"handlers": handlers, "default_handler": "crun"}}
    )
    daemon.start()
    response = daemon.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    features = {h.name: h.features for h in response.runtime_handlers}
    assert sorted(features) == ["", "crun", "runc"]
    assert features[""] == features["crun"]
    assert not features[""].recursive_read_only_mounts


def test_a_pod_runs_under_the_handler_it_names(two_handlers: Daemon, short_tmp: Path) -> None:
    with pod(two_handlers, "onsecond", short_tmp, handler="second") as p:
        status = two_handlers.runtime().PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=p[0]), timeout=10
        )
        assert status.status.runtime_handler == "second"
        container_id = create(two_handlers, p, container_config("hello", "exec sleep 60"))
        two_handlers.runtime().StartContainer(
            api_pb2.StartContainerRequest(container_id=container_id), timeout=30
        )
        # The container is the second handler's: in its runtime root, not runc's.
        assert (two_handlers.run_root / "runtime" / "second" / container_id).exists()
        assert not (two_handlers.run_root / "runtime" / "runc" / container_id).exists()
        two_handlers.runtime().StopContainer(
            api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=30
        )

    with pod(two_handlers, "oncrun", short_tmp, handler="crun") as p:
        # What this handler cannot do is refused by name, not run without it.
        rro = api_pb2.Mount(
            container_path="/v", host_path=str(short_tmp), readonly=True, recursive_read_only=True
        )
        with pytest.raises(grpc.RpcError) as failure:
            create(two_handlers, p, container_config("rro", "true", mounts=[rro]))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "runtime handler 'crun' does not support recursive" in failure.value.details()


def test_an_unknown_handler_is_refused(two_handlers: Daemon, short_tmp: Path) -> None:
    with pytest.raises(grpc.RpcError) as failure, pod(two_handlers, "x", short_tmp, handler="kata"):
        pass
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "crun, runc" in failure.value.details()


def test_update_pod_sandbox_resources_is_checked_and_recorded(
    daemon: Daemon, short_tmp: Path
) -> None:
    with pod(daemon, "resize", short_tmp) as p:
        sandbox_id = p[0]
        daemon.runtime().UpdatePodSandboxResources(
            api_pb2.UpdatePodSandboxResourcesRequest(
                pod_sandbox_id=sandbox_id,
                overhead=api_pb2.LinuxContainerResources(cpu_shares=10),
                resources=api_pb2.LinuxContainerResources(
                    cpu_quota=50_000, cpu_period=100_000, memory_limit_in_bytes=64 << 20
                ),
            ),
            timeout=10,
        )
        verbose = daemon.runtime().PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=10
        )
        recorded = json.loads(verbose.info["info"])["resources"]
        assert recorded["resources"]["memory_limit_in_bytes"] == str(64 << 20)
        assert recorded["overhead"]["cpu_shares"] == "10"

        with pytest.raises(grpc.RpcError) as bad:
            daemon.runtime().UpdatePodSandboxResources(
                api_pb2.UpdatePodSandboxResourcesRequest(
                    pod_sandbox_id=sandbox_id,
                    resources=api_pb2.LinuxContainerResources(memory_limit_in_bytes=-5),
                ),
                timeout=10,
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "memory_limit_in_bytes" in bad.value.details()

    with pytest.raises(grpc.RpcError) as gone:
        daemon.runtime().UpdatePodSandboxResources(
            api_pb2.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sandbox_id), timeout=10
        )
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_update_runtime_config_takes_the_pod_cidr(daemon: Daemon) -> None:
    daemon.runtime().UpdateRuntimeConfig(
        api_pb2.UpdateRuntimeConfigRequest(
            runtime_config=api_pb2.RuntimeConfig(
                network_config=api_pb2.NetworkConfig(pod_cidr="10.244.1.0/24")
            )
        ),
        timeout=10,
    )
    assert "10.244.1.0/24" in daemon.log()


def test_a_user_namespaced_pod_is_refused_by_a_handler_without_them(
    two_handlers: Daemon, short_tmp: Path
) -> None:
    """crun 1.8 says nothing of its features: Status does not advertise user namespaces
    for it, and a pod asking for one under it is refused rather than silently run with
    the host's ids."""
    linux = userns_linux(65536 * 3300)
    with (
        pytest.raises(grpc.RpcError) as failure,
        pod(two_handlers, "userns", short_tmp, handler="crun", linux=linux),
    ):
        pass
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not supported by runtime handler 'crun'" in failure.value.details()
    assert two_handlers.leaks() == {}
