"""The objects a request names by ID are bound to its log lines, with their names."""

from __future__ import annotations

from cri_shim.api.v1 import api_pb2
from cri_shim.creation.coordinator import CreationCoordinator
from cri_shim.daemon import bind_exited_object
from cri_shim.logcontext import bound_fields, scope
from cri_shim.server.rpc import bind_request_objects
from cri_shim.server.views import ObjectNames

SANDBOX_ID = "4f1c" * 16
CONTAINER_ID = "9a0b" * 16
POD = "k8s_POD_web_default_uid-1_0"
CTR = "k8s_app_web_default_uid-1_0"


class _NoHooks:
    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"restore calls no hook ({name})")


def services() -> ObjectNames:
    sandboxes = CreationCoordinator("sandbox", _NoHooks())  # type: ignore[arg-type]
    containers = CreationCoordinator("container", _NoHooks())  # type: ignore[arg-type]
    sandboxes.restore_visible(POD, SANDBOX_ID)
    containers.restore_visible(CTR, CONTAINER_ID)
    return ObjectNames(sandboxes, containers)


async def test_a_request_by_id_or_prefix_is_bound_to_the_object_and_its_name() -> None:
    known = services()
    with scope():
        bind_request_objects(known, api_pb2.StopPodSandboxRequest(pod_sandbox_id=SANDBOX_ID[:8]))
        assert dict(bound_fields()) == {"sandbox_id": SANDBOX_ID, "sandbox_name": POD}
    with scope():
        bind_request_objects(
            known,
            api_pb2.CreateContainerRequest(pod_sandbox_id=SANDBOX_ID),
        )
        bind_request_objects(known, api_pb2.StartContainerRequest(container_id=CONTAINER_ID))
        assert dict(bound_fields()) == {
            "sandbox_id": SANDBOX_ID,
            "sandbox_name": POD,
            "container_id": CONTAINER_ID,
            "container_name": CTR,
        }
    assert dict(bound_fields()) == {}


async def test_an_unknown_id_is_bound_as_given_and_a_request_without_one_binds_nothing() -> None:
    known = services()
    with scope():
        bind_request_objects(known, api_pb2.ContainerStatusRequest(container_id="ffff"))
        assert dict(bound_fields()) == {"container_id": "ffff"}
    with scope():
        bind_request_objects(known, api_pb2.ListPodSandboxRequest())
        bind_request_objects(known, api_pb2.VersionRequest())
        assert dict(bound_fields()) == {}


async def test_an_exit_file_is_bound_to_its_container_or_to_its_pods_pause_process() -> None:
    known = services()
    with scope():
        bind_exited_object(known, CONTAINER_ID)
        assert dict(bound_fields()) == {"container_id": CONTAINER_ID, "container_name": CTR}
    with scope():
        bind_exited_object(known, SANDBOX_ID)
        assert dict(bound_fields()) == {"sandbox_id": SANDBOX_ID, "sandbox_name": POD}
