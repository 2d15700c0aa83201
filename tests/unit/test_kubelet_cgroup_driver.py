"""tests/kubelet.py: the cgroup driver kubelet is given is the runtime's, and cgroupfs for a
runtime that predates RuntimeConfig (containerd 1.6, the density benchmark's peer)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tests.kubelet import runtime_cgroup_driver


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
