"""Status: whether the runtime and its network are ready, and its handlers' features."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import HandlerFeatures, RuntimeView


async def status(
    view: RuntimeView, request: api_pb2.StatusRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StatusResponse:
    net_ready, net_reason, net_message = view.sandboxes.network_status()
    handlers = view.containers.backends
    conditions = [
        api_pb2.RuntimeCondition(type="RuntimeReady", status=True),
        api_pb2.RuntimeCondition(
            type="NetworkReady", status=net_ready, reason=net_reason, message=net_message
        ),
    ]
    # Clients look the default handler up under the empty name (a request naming no
    # handler), so it is listed under "" too, beside its own name.
    default = view.config.runtime.default_handler
    names = ([""] if default in handlers else []) + sorted(handlers)
    response = api_pb2.StatusResponse(
        status=api_pb2.RuntimeStatus(conditions=conditions),
        runtime_handlers=[
            api_pb2.RuntimeHandler(
                name=name,
                features=_features(view.containers.features_of(name or default)),
            )
            for name in names
        ],
        # A pod with its own user namespace is refused the host's network (runtime/userns.py).
        features=api_pb2.RuntimeFeatures(
            supplemental_groups_policy=True, user_namespaces_host_network=False
        ),
    )
    if request.verbose:
        apparmor = view.containers.apparmor
        info = {
            "config": {
                "root": str(view.config.root),
                "run_root": str(view.config.run_root),
                "cgroup_manager": view.config.cgroup_manager,
                "conmon_cgroup": view.config.conmon_cgroup,
                "keep_on_timeout": view.config.creation.keep_on_timeout,
                "hand_off": view.config.creation.hand_off,
            },
            "creation": view.census.creation_stats(),
            # RuntimeDefault is the runtime's own profile; unconfined where AppArmor is off.
            "apparmor": {
                "enabled": apparmor.enabled(),
                "runtime_default": apparmor.runtime_default(),
            },
        }
        if view.census.loop_monitor is not None:
            info["eventLoop"] = view.census.loop_monitor.report()
        if tracing := view.tracer.figures():
            info["tracing"] = tracing
        response.info["info"] = json.dumps(info, sort_keys=True)
    return response


def _features(features: HandlerFeatures) -> api_pb2.RuntimeHandlerFeatures:
    return api_pb2.RuntimeHandlerFeatures(
        recursive_read_only_mounts=features.recursive_read_only_mounts,
        user_namespaces=features.user_namespaces,
    )
