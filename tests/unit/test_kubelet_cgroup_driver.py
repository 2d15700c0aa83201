"""tests/kubelet.py beside a runtime other than cri-shim (containerd 1.6, the density
benchmark's peer): the cgroup driver kubelet is given is the runtime's, cgroupfs for a
runtime that predates RuntimeConfig; a sandbox gone before it is removed is passed over."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.kubelet import remove_all_sandboxes, runtime_cgroup_driver


def serving(tmp_path: Path, handlers: list[grpc.GenericRpcHandler]) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=handlers)
    endpoint = f"unix://{tmp_path / 'runtime.sock'}"
    server.add_insecure_port(endpoint)
    server.start()
    return server, endpoint


def test_a_runtime_without_runtime_config_gets_cgroupfs(tmp_path: Path) -> None:
    server, endpoint = serving(tmp_path, [])  # every method UNIMPLEMENTED
    try:
        assert runtime_cgroup_driver(endpoint) == "cgroupfs"
    finally:
        server.stop(None)


def test_another_failure_is_not_taken_for_cgroupfs(tmp_path: Path) -> None:
    def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, "starting")

    handler = grpc.method_handlers_generic_handler(
        "runtime.v1.RuntimeService", {"RuntimeConfig": grpc.unary_unary_rpc_method_handler(refuse)}
    )
    server, endpoint = serving(tmp_path, [handler])
    try:
        with pytest.raises(grpc.RpcError) as raised:
            runtime_cgroup_driver(endpoint)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


class Gone(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND


class Runtime:
    """Lists two sandboxes; the first is gone by the time it is stopped."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def ListPodSandbox(self, request: object, timeout: float) -> api_pb2.ListPodSandboxResponse:
        return api_pb2.ListPodSandboxResponse(
            items=[api_pb2.PodSandbox(id="gone"), api_pb2.PodSandbox(id="held")]
        )

    def StopPodSandbox(self, request: api_pb2.StopPodSandboxRequest, timeout: float) -> None:
        if request.pod_sandbox_id == "gone":
            raise Gone()

    def RemovePodSandbox(self, request: api_pb2.RemovePodSandboxRequest, timeout: float) -> None:
        self.removed.append(request.pod_sandbox_id)


def test_a_sandbox_gone_meanwhile_leaves_none_of_the_others_behind() -> None:
    runtime = Runtime()
    remove_all_sandboxes(runtime)
    assert runtime.removed == ["held"]
