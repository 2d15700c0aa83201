"""The two gRPC services. Each method is one line: the handler lives in its family's module."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.server import (
    container,
    events,
    image,
    metrics_cri,
    runtime_info,
    sandbox,
    sandbox_resources,
    stats,
    streaming,
)
from cri_shim.server.rpc import rpc, unimplemented
from cri_shim.server.wire import deserializer

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView, RuntimeView

_PENDING = {
    "CheckpointContainer": "checkpointing",
}


class RuntimeService(api_pb2_grpc.RuntimeServiceServicer):
    def __init__(self) -> None:
        # None until restore has finished; every call answers UNAVAILABLE until then.
        self.view: RuntimeView | None = None

    Version = rpc(runtime_info.version)
    Status = rpc(runtime_info.status)
    RuntimeConfig = rpc(runtime_info.runtime_config)
    UpdateRuntimeConfig = rpc(runtime_info.update_runtime_config)
    RunPodSandbox = rpc(sandbox.run_pod_sandbox)
    StopPodSandbox = rpc(sandbox.stop_pod_sandbox)
    RemovePodSandbox = rpc(sandbox.remove_pod_sandbox)
    PodSandboxStatus = rpc(sandbox.pod_sandbox_status)
    ListPodSandbox = rpc(sandbox.list_pod_sandbox)
    StreamPodSandboxes = rpc(sandbox.stream_pod_sandboxes)
    CreateContainer = rpc(container.create_container)
    StartContainer = rpc(container.start_container)
    StopContainer = rpc(container.stop_container)
    RemoveContainer = rpc(container.remove_container)
    ListContainers = rpc(container.list_containers)
    StreamContainers = rpc(container.stream_containers)
    ContainerStatus = rpc(container.container_status)
    ExecSync = rpc(container.exec_sync)
    ReopenContainerLog = rpc(container.reopen_container_log)
    UpdateContainerResources = rpc(container.update_container_resources)
    Exec = rpc(streaming.exec_)
    Attach = rpc(streaming.attach)
    PortForward = rpc(streaming.port_forward)
    ContainerStats = rpc(stats.container_stats)
    ListContainerStats = rpc(stats.list_container_stats)
    StreamContainerStats = rpc(stats.stream_container_stats)
    PodSandboxStats = rpc(stats.pod_sandbox_stats)
    ListPodSandboxStats = rpc(stats.list_pod_sandbox_stats)
    StreamPodSandboxStats = rpc(stats.stream_pod_sandbox_stats)
    GetContainerEvents = rpc(events.get_container_events)
    UpdatePodSandboxResources = rpc(sandbox_resources.update_pod_sandbox_resources)
    ListMetricDescriptors = rpc(metrics_cri.list_metric_descriptors)
    ListPodSandboxMetrics = rpc(metrics_cri.list_pod_sandbox_metrics)
    StreamPodSandboxMetrics = rpc(metrics_cri.stream_pod_sandbox_metrics)


class ImageService(api_pb2_grpc.ImageServiceServicer):
    def __init__(self) -> None:
        # None until restore has finished, as RuntimeService's.
        self.view: ImageView | None = None

    ListImages = rpc(image.list_images)
    StreamImages = rpc(image.stream_images)
    ImageStatus = rpc(image.image_status)
    PullImage = rpc(image.pull_image)
    RemoveImage = rpc(image.remove_image)
    ImageFsInfo = rpc(image.image_fs_info)


def _fill_unimplemented() -> None:
    for cls, service in ((RuntimeService, "RuntimeService"), (ImageService, "ImageService")):
        methods = api_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
        for name in methods:
            if name not in cls.__dict__:
                feature = _PENDING.get(name, name)
                setattr(cls, name, unimplemented(name, f"{feature} support is not built yet"))


_fill_unimplemented()


def _serializer(message_class: Any) -> Callable[[Any], bytes]:
    """Replies as protobuf serializes them; a reply already serialized (an event sent to
    every subscriber, server/events.py) goes as it is."""
    serialize = message_class.SerializeToString

    def serialized(reply: Any) -> bytes:
        return reply if isinstance(reply, bytes) else serialize(reply)

    return serialized


def add_to_server(server: grpc.aio.Server, runtime: RuntimeService, image: ImageService) -> None:
    """Serve both services on `server`. Each method's requests are deserialized so that
    a large one is parsed off the event loop (server/wire.py); replies as protobuf does,
    or as they are when already serialized."""
    for servicer, service in ((runtime, "RuntimeService"), (image, "ImageService")):
        descriptor = api_pb2.DESCRIPTOR.services_by_name[service]
        handlers: dict[str, Any] = {}
        for method in descriptor.methods:
            assert not method.client_streaming, f"{method.full_name} streams requests"
            # Unary methods too: their handler writes the one reply itself, so that the
            # call's admission lasts until the reply has left (server/limits.py). On the
            # wire a unary reply and a stream of one message are the same.
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                getattr(servicer, method.name),
                request_deserializer=deserializer(getattr(api_pb2, method.input_type.name)),
                response_serializer=_serializer(getattr(api_pb2, method.output_type.name)),
            )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
        )
        server.add_registered_method_handlers(descriptor.full_name, handlers)
