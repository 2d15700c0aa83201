"""Version, Status and RuntimeConfig: what the runtime is and whether it is ready."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import grpc

from cri_shim import __version__
from cri_shim.api.v1 import api_pb2
from cri_shim.runtime.features import handler_features, to_cri

if TYPE_CHECKING:
    from cri_shim.server.components import Components

log = logging.getLogger("cri_shim.server")

RUNTIME_NAME = "cri-shim"
KUBE_API_VERSION = "0.1.0"


async def version(
    services: Components, request: api_pb2.VersionRequest, context: grpc.aio.ServicerContext
) -> api_pb2.VersionResponse:
    return api_pb2.VersionResponse(
        version=KUBE_API_VERSION,
        runtime_name=RUNTIME_NAME,
        runtime_version=__version__,
        runtime_api_version="v1",
    )


async def status(
    services: Components, request: api_pb2.StatusRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StatusResponse:
    net_ready, net_reason, net_message = services.sandboxes.network_status()
    backends = services.containers.backends
    conditions = [
        api_pb2.RuntimeCondition(type="RuntimeReady", status=True),
        api_pb2.RuntimeCondition(
            type="NetworkReady", status=net_ready, reason=net_reason, message=net_message
        ),
    ]
    # Clients look the default handler up under the empty name (a request naming no
    # handler), so it is listed under "" too, beside its own name.
    default = services.config.runtime.default_handler
    names = ([""] if default in backends else []) + sorted(backends)
    response = api_pb2.StatusResponse(
        status=api_pb2.RuntimeStatus(conditions=conditions),
        runtime_handlers=[
            api_pb2.RuntimeHandler(
                name=name,
                features=to_cri(handler_features(backends[name or default].runtime_path)),
            )
            for name in names
        ],
        # A pod with its own user namespace is refused the host's network (runtime/userns.py).
        features=api_pb2.RuntimeFeatures(
            supplemental_groups_policy=True, user_namespaces_host_network=False
        ),
    )
    if request.verbose:
        apparmor = services.containers.apparmor
        info = {
            "config": {
                "root": str(services.config.root),
                "run_root": str(services.config.run_root),
                "cgroup_manager": services.config.cgroup_manager,
                "keep_on_timeout": services.config.creation.keep_on_timeout,
                "hand_off": services.config.creation.hand_off,
            },
            "creation": services.creation_stats(),
            # RuntimeDefault is the runtime's own profile; unconfined where AppArmor is off.
            "apparmor": {
                "enabled": apparmor.enabled(),
                "runtime_default": apparmor.runtime_default(),
            },
        }
        if services.loop_monitor is not None:
            info["eventLoop"] = services.loop_monitor.report()
        if tracing := services.tracer.figures():
            info["tracing"] = tracing
        response.info["info"] = json.dumps(info, sort_keys=True)
    return response


async def runtime_config(
    services: Components, request: api_pb2.RuntimeConfigRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RuntimeConfigResponse:
    driver = api_pb2.SYSTEMD if services.config.cgroup_manager == "systemd" else api_pb2.CGROUPFS
    return api_pb2.RuntimeConfigResponse(
        linux=api_pb2.LinuxRuntimeConfiguration(cgroup_driver=driver)
    )


async def update_runtime_config(
    services: Components,
    request: api_pb2.UpdateRuntimeConfigRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdateRuntimeConfigResponse:
    # kubelet sends the node's pod CIDR at start. Addressing belongs to the CNI
    # configuration (as with CRI-O and containerd's default), so it is only recorded.
    cidr = request.runtime_config.network_config.pod_cidr
    if cidr:
        log.info("kubelet reports pod CIDR %s (addressing stays with the CNI configuration)", cidr)
    return api_pb2.UpdateRuntimeConfigResponse()
