"""The two gRPC services. Each method is one line: the handler lives in its family's module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cri_api.v1 import api_pb2, api_pb2_grpc

from cri_shim.server import runtime_info, sandbox
from cri_shim.server.rpc import rpc, unimplemented

if TYPE_CHECKING:
    from cri_shim.daemon import Services

_PENDING = {
    "CreateContainer": "containers", "StartContainer": "containers",
    "StopContainer": "containers", "RemoveContainer": "containers",
    "ListContainers": "containers", "ContainerStatus": "containers",
    "UpdateContainerResources": "containers", "ReopenContainerLog": "containers",
    "ExecSync": "containers", "Exec": "streaming", "Attach": "streaming",
    "PortForward": "streaming", "ContainerStats": "containers",
    "ListContainerStats": "containers", "PodSandboxStats": "containers",
    "ListPodSandboxStats": "containers",    "CheckpointContainer": "checkpointing", "GetContainerEvents": "container events",
    "ListMetricDescriptors": "CRI metrics", "ListPodSandboxMetrics": "CRI metrics",
    "UpdatePodSandboxResources": "pod resources",
    "ListImages": "images", "ImageStatus": "images", "PullImage": "image pulls",
    "RemoveImage": "images", "ImageFsInfo": "images",
}


class _Servicer:
    def __init__(self) -> None:
        # None until restore has finished; every call answers UNAVAILABLE until then.
        self.services: Services | None = None


class RuntimeService(_Servicer, api_pb2_grpc.RuntimeServiceServicer):
    Version = rpc(runtime_info.version)
    Status = rpc(runtime_info.status)
    RuntimeConfig = rpc(runtime_info.runtime_config)
    UpdateRuntimeConfig = rpc(runtime_info.update_runtime_config)
    RunPodSandbox = rpc(sandbox.run_pod_sandbox)
    StopPodSandbox = rpc(sandbox.stop_pod_sandbox)
    RemovePodSandbox = rpc(sandbox.remove_pod_sandbox)
    PodSandboxStatus = rpc(sandbox.pod_sandbox_status)
    ListPodSandbox = rpc(sandbox.list_pod_sandbox)


class ImageService(_Servicer, api_pb2_grpc.ImageServiceServicer):
    pass


def _fill_unimplemented() -> None:
    for cls, service in ((RuntimeService, "RuntimeService"), (ImageService, "ImageService")):
        methods = api_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
        for name in methods:
            if name not in cls.__dict__:
                feature = _PENDING.get(name, name)
                setattr(cls, name, unimplemented(name, f"{feature} support is not built yet"))


_fill_unimplemented()
