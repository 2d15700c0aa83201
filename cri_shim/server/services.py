"""The two gRPC services, one line per RPC: the handler lives in the module named after it
(`RunPodSandbox` in server/run_pod_sandbox.py).

The methods are registered from the proto's descriptor (add_to_server), so the generated
servicer classes (api_pb2_grpc, a module the daemon would load for nothing else) are not
their bases; a method the proto has and a class lacks answers UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import (
    attach,
    container_stats,
    container_status,
    create_container,
    exec,
    exec_sync,
    get_container_events,
    image_fs_info,
    image_status,
    list_container_stats,
    list_containers,
    list_images,
    list_metric_descriptors,
    list_pod_sandbox,
    list_pod_sandbox_metrics,
    list_pod_sandbox_stats,
    pod_sandbox_stats,
    pod_sandbox_status,
    port_forward,
    pull_image,
    remove_container,
    remove_image,
    remove_pod_sandbox,
    reopen_container_log,
    run_pod_sandbox,
    runtime_config,
    start_container,
    status,
    stop_container,
    stop_pod_sandbox,
    stream_container_stats,
    stream_containers,
    stream_images,
    stream_pod_sandbox_metrics,
    stream_pod_sandbox_stats,
    stream_pod_sandboxes,
    update_container_resources,
    update_pod_sandbox_resources,
    update_runtime_config,
    version,
)
from cri_shim.server.rpc import rpc, unimplemented
from cri_shim.server.wire import deserializer

if TYPE_CHECKING:
    from cri_shim.server.views import ImageView, RuntimeView

# The RPCs answered UNIMPLEMENTED, with the feature each waits for.
PENDING = {
    "CheckpointContainer": "checkpointing",
}


class RuntimeService:
    def __init__(self) -> None:
        # None until restore has finished; every call answers UNAVAILABLE until then.
        self.view: RuntimeView | None = None

    Version = rpc(version.version)
    Status = rpc(status.status)
    RuntimeConfig = rpc(runtime_config.runtime_config)
    UpdateRuntimeConfig = rpc(update_runtime_config.update_runtime_config)
    RunPodSandbox = rpc(run_pod_sandbox.run_pod_sandbox)
    StopPodSandbox = rpc(stop_pod_sandbox.stop_pod_sandbox)
    RemovePodSandbox = rpc(remove_pod_sandbox.remove_pod_sandbox)
    PodSandboxStatus = rpc(pod_sandbox_status.pod_sandbox_status)
    ListPodSandbox = rpc(list_pod_sandbox.list_pod_sandbox)
    StreamPodSandboxes = rpc(stream_pod_sandboxes.stream_pod_sandboxes)
    CreateContainer = rpc(create_container.create_container)
    StartContainer = rpc(start_container.start_container)
    StopContainer = rpc(stop_container.stop_container)
    RemoveContainer = rpc(remove_container.remove_container)
    ListContainers = rpc(list_containers.list_containers)
    StreamContainers = rpc(stream_containers.stream_containers)
    ContainerStatus = rpc(container_status.container_status)
    ExecSync = rpc(exec_sync.exec_sync)
    ReopenContainerLog = rpc(reopen_container_log.reopen_container_log)
    UpdateContainerResources = rpc(update_container_resources.update_container_resources)
    Exec = rpc(exec.exec_)
    Attach = rpc(attach.attach)
    PortForward = rpc(port_forward.port_forward)
    ContainerStats = rpc(container_stats.container_stats)
    ListContainerStats = rpc(list_container_stats.list_container_stats)
    StreamContainerStats = rpc(stream_container_stats.stream_container_stats)
    PodSandboxStats = rpc(pod_sandbox_stats.pod_sandbox_stats)
    ListPodSandboxStats = rpc(list_pod_sandbox_stats.list_pod_sandbox_stats)
    StreamPodSandboxStats = rpc(stream_pod_sandbox_stats.stream_pod_sandbox_stats)
    GetContainerEvents = rpc(get_container_events.get_container_events)
    UpdatePodSandboxResources = rpc(update_pod_sandbox_resources.update_pod_sandbox_resources)
    ListMetricDescriptors = rpc(list_metric_descriptors.list_metric_descriptors)
    ListPodSandboxMetrics = rpc(list_pod_sandbox_metrics.list_pod_sandbox_metrics)
    StreamPodSandboxMetrics = rpc(stream_pod_sandbox_metrics.stream_pod_sandbox_metrics)


class ImageService:
    def __init__(self) -> None:
        # None until restore has finished, as RuntimeService's.
        self.view: ImageView | None = None

    ListImages = rpc(list_images.list_images)
    StreamImages = rpc(stream_images.stream_images)
    ImageStatus = rpc(image_status.image_status)
    PullImage = rpc(pull_image.pull_image)
    RemoveImage = rpc(remove_image.remove_image)
    ImageFsInfo = rpc(image_fs_info.image_fs_info)


def _fill_unimplemented() -> None:
    for cls, service in ((RuntimeService, "RuntimeService"), (ImageService, "ImageService")):
        methods = api_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
        for name in methods:
            if name not in cls.__dict__:
                feature = PENDING.get(name, name)
                setattr(cls, name, unimplemented(name, f"{feature} support is not built yet"))


_fill_unimplemented()


def _serializer(message_class: Any) -> Callable[[Any], bytes]:
    """Replies as protobuf serializes them; a reply already serialized (a unary reply,
    server/limits.py hold_reply; an event sent to every subscriber, lifecycle/statuses.py)
    goes as it is."""
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
            # A unary reply is counted until gRPC lets its call go (server/limits.py).
            kind = (
                grpc.unary_stream_rpc_method_handler
                if method.server_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            handlers[method.name] = kind(
                getattr(servicer, method.name),
                request_deserializer=deserializer(getattr(api_pb2, method.input_type.name)),
                response_serializer=_serializer(getattr(api_pb2, method.output_type.name)),
            )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
        )
        server.add_registered_method_handlers(descriptor.full_name, handlers)
