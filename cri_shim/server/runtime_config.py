"""RuntimeConfig: the cgroup driver the daemon resolved, which kubelet takes as its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def runtime_config(
    view: RuntimeView, request: api_pb2.RuntimeConfigRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RuntimeConfigResponse:
    # kubelet (KubeletCgroupDriverFromCRI) takes its driver from this answer: the one the
    # daemon resolved at its start (config.cgroup_manager, `auto` no longer).
    driver = api_pb2.SYSTEMD if view.config.cgroup_manager == "systemd" else api_pb2.CGROUPFS
    return api_pb2.RuntimeConfigResponse(
        linux=api_pb2.LinuxRuntimeConfiguration(cgroup_driver=driver)
    )
